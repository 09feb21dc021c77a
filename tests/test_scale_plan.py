"""``benchmarks/scale.py``'s plan: replica chains and rollouts in flight chosen so no process passes its fd limit."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "scale.py"
_spec = importlib.util.spec_from_file_location("scale_benchmark", _SCRIPT)
assert _spec is not None and _spec.loader is not None
scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale)

LIMIT = 20_000
PER_PROCESS = 9_000


@pytest.mark.parametrize(
    ("rollouts", "expected"),
    [(1_000, (1, 1_000)), (9_000, (1, 9_000)), (9_001, (2, 9_001)), (16_000, (2, 16_000))],
)
def test_default_replicas_hold_every_rollout_with_each_chain_under_its_budget(
    rollouts: int, expected: tuple[int, int]
) -> None:
    assert scale.plan(rollouts, None, None, PER_PROCESS, LIMIT) == expected


def test_by_default_the_rollouts_in_flight_stay_under_the_controllers_own_limit() -> None:
    # 30,000 rollouts over four chains: the chains could hold 36,000, the controller and backend not.
    replicas, in_flight = scale.plan(30_000, None, None, PER_PROCESS, LIMIT)
    assert replicas == 4 and in_flight < LIMIT


def test_an_explicit_replica_count_caps_what_is_in_flight_at_its_chains_budget() -> None:
    assert scale.plan(16_000, 1, None, PER_PROCESS, LIMIT) == (1, 9_000)


def test_too_few_replicas_for_the_rollouts_asked_in_flight_is_refused() -> None:
    with pytest.raises(ValueError, match="per replica chain"):
        scale.plan(16_000, 1, 16_000, PER_PROCESS, LIMIT)


def test_more_in_flight_than_one_controller_holds_is_refused() -> None:
    with pytest.raises(ValueError, match="this controller"):
        scale.plan(24_000, 3, 24_000, PER_PROCESS, LIMIT)


def test_cleanup_timeouts_are_counted_from_each_environments_log(tmp_path: Path) -> None:
    line = "ERROR Episode cleanup timed out: episode_id=rollout_id='scale-7' attempt=1\n"
    (tmp_path / "single_agent_turn.log").write_text(line * 2 + "INFO other\n")
    (tmp_path / "single_agent_turn_2.log").write_text(line)
    (tmp_path / "simple_agent.log").write_text(line)  # not an environment: not counted
    assert scale.cleanup_timeouts(tmp_path, ["single_agent_turn", "single_agent_turn_2", "single_agent_turn_3"]) == 3


def test_network_losses_are_read_from_the_kernel_as_differences() -> None:
    stats = importlib.import_module("process_stats")  # scale.py put benchmarks/ on sys.path
    before = stats.net_counters()
    if before is None:
        pytest.skip("no /proc/net counters here")
    assert set(before) == {"softnet_dropped", "retransmitted_segments", "retransmit_timeouts", "syn_retransmits"}
    assert all(isinstance(v, int) and v >= 0 for v in before.values())
    since = stats.counters_since(before)
    assert since is not None and set(since) == set(before) and all(v >= 0 for v in since.values())
    assert stats.counters_since(None) is None


def test_periodic_summary_takes_the_longest_pause_after_the_first_and_the_share_of_the_window() -> None:
    periodic = importlib.import_module("scale_periodic")  # scale.py put benchmarks/ on sys.path
    checkpoints = [
        {"pause_s": 5.0, "bytes": 1000},
        {"pause_s": 0.5, "bytes": 100},
        {"pause_s": 0.7, "bytes": 300},
    ]
    summary = periodic.summarize(checkpoints, 62.0)
    # The first (full) checkpoint's pause is not a periodic one: pause_s_max is over the later ones.
    assert summary["pause_s_max"] == 0.7 and summary["pause_s_first"] == 5.0
    assert summary["pause_share"] == round(6.2 / 62.0, 5)
    assert summary["bytes_full"] == 1000 and summary["bytes_incremental"] == 200
    assert periodic.summarize(checkpoints[:1], 10.0)["pause_s_max"] is None


def test_periodic_generation_keeps_the_machine_ahead_of_the_rollouts() -> None:
    periodic = importlib.import_module("scale_periodic")
    # Two calls per rollout: N / (2 * N / 50) = 25 rollouts a second whatever N (at least 5 s a call).
    assert periodic.default_generation_seconds(16_000) == 320.0
    assert periodic.default_generation_seconds(100) == 5.0
