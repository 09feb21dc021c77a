"""The coordination library against real participant servers: orders seen in the participants' own logs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from coord_support import FOUR, TOKEN, config_for, start_participants, stop_participants

from nemo_gym_checkpoint_plugin._markers import hookimpl
from nemo_gym_checkpoint_plugin._storage import read_checkpoint
from nemo_gym_checkpoint_plugin.coordination import (
    CoordinationError,
    commit,
    discover,
    forget,
    prepare,
    renew,
    restore,
    resume,
    retire,
)
from nemo_gym_checkpoint_plugin.coordination import _coordinator as coordinator_module
from nemo_gym_checkpoint_plugin.coordination._order import order_manager

pytestmark = pytest.mark.slow

HOLDS = ["r1", "r2-a1", "r3"]


@pytest.fixture
def four(tmp_path):
    (tmp_path / "barrier").mkdir()
    together = {"commit": 4, "renew": 4, "restore": 4}
    specs = [dict(spec, holds=HOLDS, barrier_dir=str(tmp_path / "barrier"), barrier=dict(together)) for spec in FOUR]
    for spec in specs[1], specs[3]:  # model and resources retire and forget in one stage
        spec["barrier"].update(retire=2, forget=2)
    servers = start_participants(tmp_path, specs)
    yield {s.kind: s for s in servers}
    stop_participants(servers)


def before(earlier_server, earlier_op, earlier_event, later_server, later_op, later_event) -> bool:
    return earlier_server.first(earlier_op, earlier_event) < later_server.first(later_op, later_event)


def assert_all_at_once(servers, op: str) -> None:
    """Every call arrived before any reply was sent: the calls were in flight together."""
    last_arrival = max(s.first(op, "arrive") for s in servers)
    first_reply = min(s.first(op, "reply") for s in servers)
    assert last_arrival < first_reply, f"{op} was not sent to every participant at once"


def assert_stage_order(stages, op: str) -> None:
    """Each stage's calls arrive only after every call of the previous stage replied."""
    for previous, following in zip(stages, stages[1:], strict=False):
        replied = max(s.first(op, "reply") for s in previous)
        arrived = min(s.first(op, "arrive") for s in following)
        assert replied < arrived, f"{op}: {[s.name for s in following]} called before {[s.name for s in previous]}"


def same_body(servers, op: str) -> None:
    digests = {e["sha"] for s in servers for e in s.events() if e["op"] == op and e.get("event") == "arrive"}
    assert len(digests) == 1, f"{op} bodies differ between participants: {digests}"


async def test_orders_of_every_operation_seen_by_the_participants(four, tmp_path, monkeypatch):
    env, model, agent, tools = four["environment"], four["model"], four["agent"], four["resources"]
    monkeypatch.setenv("COORD_TEST_TOKEN", TOKEN)
    encoded = []
    real_encode = coordinator_module.encode_body

    def counting_encode(payload):
        encoded.append(payload)
        return real_encode(payload)

    monkeypatch.setattr(coordinator_module, "encode_body", counting_encode)
    ckpt = tmp_path / "ckpt"
    async with await discover(config_for(list(four.values()))) as coordinator:
        assert sorted(p.kind for p in coordinator.participants) == sorted(four)

        result = await prepare(coordinator, "step-1", timeout=10)
        assert result.ready and result.stopped_at is None
        assert_stage_order([[env], [model], [agent], [tools]], "prepare")
        same_body(four.values(), "prepare")
        assert len(encoded) == 1, "a prepare of four stages encodes its body once"

        scope = result.continued(["r1", {"rollout_id": "r2", "attempt": 1}])
        committed = await commit(coordinator, "step-1", str(ckpt), scope, timeout=10)
        assert_all_at_once(four.values(), "commit")
        same_body(four.values(), "commit")
        assert all(keys == ["r1", "r2-a1"] for keys in committed.episode_ids.values())
        for server in four.values():
            on_disk = read_checkpoint(ckpt, server.kind, server.spec["instance"])
            assert [r["episode_id"] for r in on_disk.records] == [
                {"rollout_id": "r1", "attempt": 0},
                {"rollout_id": "r2", "attempt": 1},
            ]

        leases = await renew(coordinator, "step-1", timeout=10)
        assert set(leases) == set(s.name for s in four.values())
        assert_all_at_once(four.values(), "renew")

        resumed = await resume(coordinator, "step-1", timeout=10)
        assert {reply["phase"] for reply in resumed.values()} == {"idle"}
        assert_stage_order([[tools], [agent], [model], [env]], "resume")
        same_body(four.values(), "resume")

        restored = await restore(coordinator, "restore-1", str(ckpt), ["r1", "r2-a1"], timeout=10)
        assert restored.source_checkpoint_id == "step-1"
        assert restored.restored() == ["r1-a1", "r2-a2"]
        assert_all_at_once(four.values(), "restore")

        await retire(coordinator, "restore-1", ["r3"], timeout=10)
        assert_stage_order([[env], [agent], [model, tools]], "retire")
        assert_all_at_once([model, tools], "retire")
        await resume(coordinator, "restore-1", timeout=10)

        await forget(coordinator, "cleanup-1", ["r3"], timeout=10)
        assert_stage_order([[env], [agent], [model, tools]], "forget")
        assert_all_at_once([model, tools], "forget")
        same_body(four.values(), "forget")
    # One encoding per fan-out: prepare, commit, renew, resume, restore, retire, resume, forget.
    assert len(encoded) == 8


async def test_prepare_stops_at_the_first_stage_not_ready(tmp_path, monkeypatch):
    specs = [dict(spec) for spec in FOUR]
    specs[1]["blockers"] = ["r7", "r8-a2"]  # the model cannot become ready
    servers = start_participants(tmp_path, specs)
    try:
        env, model, agent, tools = servers
        async with await discover([s.url for s in servers], TOKEN) as coordinator:
            result = await prepare(coordinator, "step-2", deadline_ts=time.time() + 1.0)
            assert not result.ready
            assert result.stopped_at == ["model"]
            assert sorted(result.not_reached) == sorted([agent.name, tools.name])
            assert result.blockers() == ["r7", "r8-a2"] and result.blocker_count() == 2
            assert result.phases[model.name] == "preparing"
            assert "prepare" in env.ops() and "prepare" in model.ops()
            assert "prepare" not in agent.ops() and "prepare" not in tools.ops()
            # The controller resumes everyone, including the stages prepare never reached.
            replies = await resume(coordinator, "step-2", timeout=10)
            assert replies[agent.name]["idempotent"] is True and replies[model.name]["idempotent"] is False
    finally:
        stop_participants(servers)


async def test_continued_leaves_the_restarts_out(tmp_path):
    specs = [dict(spec) for spec in FOUR]
    specs[2]["restarts"] = ["r2"]  # the agent cannot capture r2
    servers = start_participants(tmp_path, specs[:3])
    try:
        async with await discover([s.url for s in servers], TOKEN) as coordinator:
            result = await prepare(coordinator, "step-3", timeout=10)
            assert result.ready and result.restarts() == ["r2"]
            assert result.continued(["r1", "r2", "r3-a1", "r1"]) == [
                {"rollout_id": "r1", "attempt": 0},
                {"rollout_id": "r3", "attempt": 1},
            ]
            await resume(coordinator, "step-3", timeout=10)
    finally:
        stop_participants(servers)


class ModelLastOrder:
    """A plugin that prepares the model after everything else (replacing the default through the hook)."""

    @hookimpl
    def coordination_order(self, operation: str):
        if operation == "prepare":
            return [["environment"], ["agent"], ["resources"], ["model"]]
        return None


async def test_a_plugin_replaces_the_order(tmp_path):
    pm = order_manager([ModelLastOrder()], load_entry_points=False)
    servers = start_participants(tmp_path, [dict(spec) for spec in FOUR])
    try:
        env, model, agent, tools = servers
        async with await discover([s.url for s in servers], TOKEN, pm=pm) as coordinator:
            assert (await prepare(coordinator, "step-4", timeout=10)).ready
            assert_stage_order([[env], [agent], [tools], [model]], "prepare")
            await resume(coordinator, "step-4", timeout=10)
            # resume is not answered by the plugin: the default reverse order applies.
            assert_stage_order([[tools], [agent], [model], [env]], "resume")
    finally:
        stop_participants(servers)


async def test_commit_failure_names_each_server_and_code(tmp_path):
    specs = [dict(spec, holds=["r1"]) for spec in FOUR]
    specs[0]["export_error"] = "export_failed"  # the environment's export fails
    specs[3]["restarts"] = ["r9"]  # the resources server cannot capture r9...
    servers = start_participants(tmp_path, specs)
    try:
        async with await discover([s.url for s in servers], TOKEN) as coordinator:
            assert (await prepare(coordinator, "step-5", timeout=10)).ready
            with pytest.raises(CoordinationError) as caught:
                # ...and a controller that ignored PrepareResult.continued names it in the scope.
                await commit(coordinator, "step-5", str(tmp_path / "c"), ["r1", "r9"], timeout=10)
            assert caught.value.codes == {servers[0].name: "export_failed", servers[3].name: "restart_in_scope"}
            assert all(f.status == 409 for f in caught.value.failures)
            assert set(caught.value.result.replies) == {servers[1].name, servers[2].name}
            await resume(coordinator, "step-5", timeout=10)
    finally:
        stop_participants(servers)
    assert Path(tmp_path / "c" / "gym" / "model" / "policy_model" / "manifest.json").exists()


class SkipsTheModel:
    @hookimpl
    def coordination_order(self, operation: str):
        return [["environment"], ["agent"], ["resources"]]


async def test_an_order_that_skips_a_kind_fails_before_any_call(tmp_path):
    from nemo_gym_checkpoint_plugin.coordination import ControlTransport, Coordinator, Participant

    class NoCalls(ControlTransport):
        async def call(self, *args, **kwargs):
            raise AssertionError("no call may be sent")

    pm = order_manager([SkipsTheModel()], load_entry_points=False)
    coordinator = Coordinator([Participant("m", "http://127.0.0.1:9", "model", "m")], NoCalls(TOKEN), pm=pm)
    with pytest.raises(ValueError, match="exactly once"):
        await coordinator.prepare("step-1", timeout=1)


def test_continued_accepts_every_form_of_episode_id():
    from nemo_gym_checkpoint_plugin._identity import EpisodeId
    from nemo_gym_checkpoint_plugin.coordination import PrepareResult

    result = PrepareResult("c", reports={"a": {"ready": True, "restarts": ["r2-a1"]}, "b": {"restarts": ["r4"]}})
    scope = result.continued([EpisodeId(rollout_id="r1", attempt=3), {"rollout_id": "r2", "attempt": 1}, "r3", "r4"])
    assert scope == [{"rollout_id": "r1", "attempt": 3}, {"rollout_id": "r3", "attempt": 0}]
    assert result.restarts() == ["r2-a1", "r4"]
