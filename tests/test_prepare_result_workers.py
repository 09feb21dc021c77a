"""The controller side keeps a report's ``worker_blockers`` apart from its capture-key blockers."""

from __future__ import annotations

from nemo_gym_checkpoint_plugin._types import Readiness, merge_readiness
from nemo_gym_checkpoint_plugin.coordination._results import PrepareResult


def test_worker_blockers_make_a_report_not_ready_and_stay_out_of_blockers() -> None:
    report = merge_readiness(
        [Readiness(blockers=["r1"]), Readiness(worker_blockers=["worker 7 disconnected during c1"])]
    )
    assert not report.ready
    wire = report.to_wire()
    assert wire["blockers"] == ["r1"] and wire["worker_blockers"] == ["worker 7 disconnected during c1"]
    only_workers = merge_readiness([Readiness(worker_blockers=["worker not registered (1 of 2), #1"])])
    assert not only_workers.ready and only_workers.to_wire()["blocker_count"] == 0
    assert "worker_blockers" not in merge_readiness([Readiness(blockers=["r1"])]).to_wire()


def test_a_prepare_result_names_the_workers_that_blocked() -> None:
    result = PrepareResult("c1")
    result.phases = {"env": "preparing", "model": "prepared"}
    result.reports = {
        "env": {"ready": False, "blockers": [], "blocker_count": 0, "worker_blockers": ["worker 7 disconnected"]},
        "model": {"ready": True, "blockers": [], "blocker_count": 0},
    }
    assert not result.ready
    assert result.blockers() == [] and result.worker_blockers() == ["worker 7 disconnected"]
    assert result.to_json()["worker_blockers"] == ["worker 7 disconnected"]
    result.reports["env"] = {"ready": True, "blockers": [], "blocker_count": 0}
    assert "worker_blockers" not in result.to_json()
