"""Controller fidelity of the checkpointed collector: explicit ``-aN`` ids in both of Gym's request paths,
``/run`` never resent, final rollouts forgotten, a failed restore starting rows over (never losing one)."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from aiohttp import ClientError, web
from nemo_gym import server_utils
from nemo_gym.rollout_collection import RolloutCollectionConfig, _episode_request_body
from nemo_gym.server_utils import BaseServerConfig, GlobalAIOHTTPAsyncClientConfig, set_global_aiohttp_client
from omegaconf import OmegaConf

from nemo_gym_checkpoint_plugin._identity import capture_key
from nemo_gym_checkpoint_plugin.coordination._checkpointer import CollectionCheckpointer
from nemo_gym_checkpoint_plugin.coordination._collection import (
    CheckpointingCollectionHelper,
    CollectorServerClient,
    RunTracker,
)
from nemo_gym_checkpoint_plugin.coordination._collector_state import CheckpointStore, CollectorState, RowState
from nemo_gym_checkpoint_plugin.coordination._errors import CoordinationError, ParticipantFailure

TASK = {
    "task_id": {"taskset": "example_single_tool_call", "task_id": "t7"},
    "task_input": {"responses_create_params": {"input": [{"role": "user", "content": "hi"}]}},
}


# -- the typed single_agent_turn path (Gym's _episode_request_body) --------------------------------


class _RunServer:
    """A real HTTP server on 127.0.0.1 whose ``/run`` records each body; ``drop_first`` cuts the first connection."""

    def __init__(self, drop_first: bool) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.drop_first = drop_first

    async def run(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        if self.drop_first and len(self.bodies) == 1:
            assert request.transport is not None
            request.transport.close()  # the connection drops: what a crashed server looks like to the caller
            return web.Response()
        return web.json_response({"ok": True})

    async def __aenter__(self) -> int:
        # Gym's shared aiohttp client, made on this loop (Gym makes it on first use from its global config).
        set_global_aiohttp_client(cfg=GlobalAIOHTTPAsyncClientConfig())
        app = web.Application()
        app.router.add_post("/run", self.run)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return port

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()
        await server_utils._GLOBAL_AIOHTTP_CLIENT.close()
        server_utils._GLOBAL_AIOHTTP_CLIENT = None


def _client(port: int, tracker: RunTracker) -> CollectorServerClient:
    config = OmegaConf.create(
        {"env": {"environment_servers": {"single_agent_turn": {"host": "127.0.0.1", "port": port}}}}
    )
    head = BaseServerConfig(host="127.0.0.1", port=port)
    return CollectorServerClient(head_server_config=head, global_config_dict=config).track(tracker)


def test_an_explicit_attempt_id_goes_out_as_that_attempt_on_the_typed_path() -> None:
    row = {**TASK, "_ng_task_index": 7, "_ng_rollout_index": 0, "_ng_rollout_id": "r7-a2"}
    body = _episode_request_body(row)
    assert body["episode_id"] == {"rollout_id": "r7-a2", "attempt": 0}  # what Gym alone sends: refused everywhere

    async def scenario() -> list[dict[str, Any]]:
        server = _RunServer(drop_first=False)
        async with server as port:
            reply = await _client(port, RunTracker()).post(server_name="env", url_path="/run", json=body)
            assert reply.ok
        return server.bodies

    (sent,) = asyncio.run(scenario())
    assert sent["episode_id"] == {"rollout_id": "r7", "attempt": 2}
    assert sent["task"] == body["task"]


def test_an_explicit_suffix_with_an_attempt_index_is_refused_before_sending() -> None:
    body = _episode_request_body({**TASK, "_ng_rollout_id": "r7-a2", "_ng_attempt_index": 1})

    async def scenario() -> list[dict[str, Any]]:
        server = _RunServer(drop_first=False)
        async with server as port:
            with pytest.raises(ValueError, match="already names attempt 2"):
                await _client(port, RunTracker()).post(server_name="env", url_path="/run", json=body)
        return server.bodies

    assert asyncio.run(scenario()) == []


def test_run_is_never_resent_after_a_dropped_connection() -> None:
    tracker = RunTracker()

    async def scenario() -> list[dict[str, Any]]:
        server = _RunServer(drop_first=True)
        async with server as port:
            with pytest.raises(ClientError):
                await _client(port, tracker).post(
                    server_name="env",
                    url_path="/run",
                    json=_episode_request_body({**TASK, "_ng_task_index": 3, "_ng_rollout_index": 0}),
                )
        return server.bodies

    assert len(asyncio.run(scenario())) == 1  # Gym's own client sends it again, and again
    assert tracker.in_flight == {} and tracker.failed == 1 and tracker.final == []


# -- the single_agent_turn_legacy row wrapper (server side, overridden from the plugin) ---------------


def _legacy_server(book: bool) -> Any:
    from environment_servers.single_agent_turn_legacy.app import SingleAgentTurnLegacyEnvironmentServer

    from nemo_gym_checkpoint_plugin.wrap import derive_checkpointable

    config = SimpleNamespace(
        resources_server=SimpleNamespace(name="res"),
        agent_server=SimpleNamespace(name="agent"),
        name="env",
        max_concurrent_episodes=None,
        queue_timeout_seconds=None,
    )
    server = derive_checkpointable(SingleAgentTurnLegacyEnvironmentServer).model_construct(config=config)
    if book:
        server._ng_episode_book = object()  # checkpointing on: what bind_episode_book sets
    return server


LEGACY_ROW = {
    "_ng_task_index": 7,
    "_ng_rollout_index": 0,
    "responses_create_params": {"input": [{"role": "user", "content": "hi"}]},
}


def test_the_legacy_row_wrapper_decodes_an_explicit_attempt_id() -> None:
    request = _legacy_server(book=True)._episode_request_from_row({**LEGACY_ROW, "_ng_rollout_id": "r7-a2"})
    assert (request.episode_id.rollout_id, request.episode_id.attempt) == ("r7", 2)
    plain = _legacy_server(book=True)._episode_request_from_row(
        {**LEGACY_ROW, "_ng_rollout_id": "r7", "_ng_attempt_index": 1}
    )
    assert (plain.episode_id.rollout_id, plain.episode_id.attempt) == ("r7", 1)


def test_the_legacy_row_wrapper_refuses_an_ambiguous_id_and_is_gyms_own_with_checkpointing_off() -> None:
    from nemo_gym_checkpoint_plugin._errors import AmbiguousEpisode

    with pytest.raises(AmbiguousEpisode) as refused:
        _legacy_server(book=True)._episode_request_from_row(
            {**LEGACY_ROW, "_ng_rollout_id": "r7-a2", "_ng_attempt_index": 1}
        )
    assert refused.value.status == 422 and "already names attempt 2" in refused.value.detail
    with pytest.raises(ValueError, match="reserved attempt suffix"):
        _legacy_server(book=False)._episode_request_from_row({**LEGACY_ROW, "_ng_rollout_id": "r7-a2"})


# -- forget and restore, against a recording coordinator ------------------------------------------


class _Coordinator:
    def __init__(self, restore_error: CoordinationError | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.restore_error = restore_error

    async def forget(self, checkpoint_id: str, rollout_ids: list[str], **_: Any) -> dict[str, Any]:
        self.calls.append(("forget", list(rollout_ids)))
        return {}

    async def restore(self, checkpoint_id: str, checkpoint_dir: str, episode_ids: list[Any], **_: Any) -> Any:
        self.calls.append(("restore", list(episode_ids)))
        if self.restore_error is not None:
            raise self.restore_error
        keys = [capture_key(e["rollout_id"], e["attempt"] + 1) for e in episode_ids]
        return SimpleNamespace(restored=lambda: sorted(keys))

    async def resume(self, checkpoint_id: str, **_: Any) -> dict[str, Any]:
        self.calls.append(("resume", checkpoint_id))
        return {}

    async def retire(self, checkpoint_id: str, episode_ids: list[Any], **_: Any) -> dict[str, Any]:
        self.calls.append(("retire", list(episode_ids)))
        return {}


def _checkpointer(coordinator: Any, tracker: RunTracker, tmp_path: Any) -> CollectionCheckpointer:
    return CollectionCheckpointer(
        coordinator,
        CheckpointStore(tmp_path / "ckpt"),
        tracker,
        every=1.0,
        keep=2,
        deployment={},
        output_path=tmp_path / "out.jsonl",
    )


def _state(tmp_path: Any) -> CollectorState:
    rows = [
        RowState("0-0", 0, "continued"),
        RowState("1-0", 1, "continued"),
        RowState("2-0", 0, "restart"),
        RowState("3-0", 0, "continued"),
    ]
    return CollectorState("collect-000004", {}, rows, path=tmp_path / "ckpt" / "collect-000004")


def test_a_final_rollout_is_forgotten_on_every_participant_and_restored_ones_too(tmp_path: Any) -> None:
    coordinator, tracker = _Coordinator(), RunTracker()
    checkpointer = _checkpointer(coordinator, tracker, tmp_path)

    async def scenario() -> None:
        plan = await checkpointer.restore_from(_state(tmp_path), finished={"3-0"})
        # The restart (2-0) is retired at its checkpointed attempt and goes out as the next one.
        assert plan.continued == ["0-0", "1-0"] and plan.attempts == {"0-0": 1, "1-0": 2, "2-0": 1}
        for rollout, attempt in (("0-0", 1), ("1-0", 2), ("5-0", 0)):
            tracker.started(rollout, attempt)
        tracker.ended("0-0", ok=True)
        tracker.ended("5-0", ok=True)
        await checkpointer.forget_final()
        tracker.ended("1-0", ok=True)
        await checkpointer.forget_final()
        await checkpointer.forget_final()  # nothing final since: no call

    asyncio.run(scenario())
    forgets = [ids for name, ids in coordinator.calls if name == "forget"]
    assert forgets == [["0-0", "5-0"], ["1-0"]]
    # A row already in the output is not restored: it is final.
    (restore,) = [ids for name, ids in coordinator.calls if name == "restore"]
    assert restore == [{"rollout_id": "0-0", "attempt": 0}, {"rollout_id": "1-0", "attempt": 1}]
    assert [ids for name, ids in coordinator.calls if name == "retire"] == [[{"rollout_id": "2-0", "attempt": 0}]]


def test_a_failed_restore_starts_those_rows_over_past_the_retired_attempts(tmp_path: Any) -> None:
    failure = CoordinationError(
        "restore",
        [ParticipantFailure("env", "http://x", "restore", "invalid_checkpoint_state", "bad records")],
        result={"next_attempts": {"0-0": 2, "1-0": 3}},
    )
    checkpointer = _checkpointer(_Coordinator(restore_error=failure), RunTracker(), tmp_path)
    plan = asyncio.run(checkpointer.restore_from(_state(tmp_path), finished=()))
    assert plan.continued == [] and plan.problem and "restore failed" in plan.problem
    assert plan.attempts == {"0-0": 2, "1-0": 3, "3-0": 2, "2-0": 1}
    assert sorted(plan.restarted) == ["0-0", "1-0", "2-0", "3-0"]  # none lost: every row goes out again


def test_gyms_resume_from_cache_sends_continued_rows_as_their_next_attempt(tmp_path: Any) -> None:
    output = tmp_path / "out.jsonl"
    config = RolloutCollectionConfig(
        input_jsonl_fpath=str(tmp_path / "in.jsonl"), output_jsonl_fpath=str(output), resume_from_cache=True
    )
    rows = [{**TASK, "_ng_task_index": i, "_ng_rollout_index": 0} for i in range(4)]
    rows[3]["_ng_rollout_id"] = "x3-a1"
    config.materialized_jsonl_fpath.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    output.write_bytes(orjson.dumps({**rows[0], "reward": 1.0}) + b"\n")
    helper = CheckpointingCollectionHelper()
    helper.set_attempts({"2-0": 1, "x3": 2})
    input_rows, *_ = helper._load_from_cache(config, retain_results_in_memory=True, success_keys=set())
    by_task = {r["_ng_task_index"]: r for r in input_rows}
    assert sorted(by_task) == [1, 2, 3] and [r["_ng_task_index"] for r in input_rows][:2] == [2, 3]
    assert "_ng_attempt_index" not in by_task[1]
    assert _episode_request_body(by_task[2])["episode_id"] == {"rollout_id": "2-0", "attempt": 1}
    assert by_task[3]["_ng_rollout_id"] == "x3-a2" and "_ng_attempt_index" not in by_task[3]
    assert (helper.total, helper.done_before) == (4, 1)


def test_the_legacy_row_wrapper_types_gyms_refusal_of_a_row_without_task_identity() -> None:
    from nemo_gym_checkpoint_plugin._errors import InvalidRunRequest

    row = {k: v for k, v in LEGACY_ROW.items() if k != "_ng_task_index"}
    with pytest.raises(InvalidRunRequest) as refused:
        _legacy_server(book=True)._episode_request_from_row({**row, "_ng_rollout_id": "3-0-a1"})
    assert refused.value.status == 422 and "requires a non-negative task_index" in refused.value.detail
    with pytest.raises(InvalidRunRequest, match="names none of this Environment Server's instances"):
        _legacy_server(book=True)._episode_request_from_row(
            {**LEGACY_ROW, "_ng_rollout_id": "r1", "task_source": "elsewhere"}
        )
    with pytest.raises(ValueError, match="requires a non-negative task_index"):  # checkpointing off: Gym's own
        _legacy_server(book=False)._episode_request_from_row({**row, "_ng_rollout_id": "3-0"})


class _CheckpointingCoordinator(_Coordinator):
    """Also prepares (ready, no restarts) and commits: every server exports each episode of the scope."""

    async def prepare(self, checkpoint_id: str, **_: Any) -> Any:
        from nemo_gym_checkpoint_plugin.coordination._results import PrepareResult

        self.calls.append(("prepare", checkpoint_id))
        return PrepareResult(
            checkpoint_id, reports={"env": {"ready": True, "blockers": [], "restarts": []}}, phases={"env": "prepared"}
        )

    async def commit(self, checkpoint_id: str, checkpoint_dir: str, episode_ids: list[Any], **_: Any) -> Any:
        from nemo_gym_checkpoint_plugin.coordination._results import CommitResult

        self.calls.append(("commit", list(episode_ids)))
        keys = [capture_key(e["rollout_id"], e["attempt"]) for e in episode_ids]
        return CommitResult(checkpoint_id, replies={"env": {"manifest": {}, "episode_ids": keys}})


def test_restored_rows_not_yet_dispatched_are_carried_by_the_next_checkpoint(tmp_path: Any) -> None:
    # Issue 30: after a restore, Gym dispatches rows as its concurrency allows. A checkpoint taken before a
    # restored row went out committed only the /run calls in flight, so the servers deleted that row's
    # restored state (outside the scope) and the collector's state lost it: a crash then lost the row.
    coordinator, tracker = _CheckpointingCoordinator(), RunTracker()
    (tmp_path / "ckpt").mkdir()
    checkpointer = _checkpointer(coordinator, tracker, tmp_path)
    written: list[CollectorState] = []
    write_records = checkpointer.store.write_records

    def recorded(state: CollectorState) -> tuple[str, int]:
        written.append(state)  # the collector's state as published (no Gym records here to verify it by)
        return write_records(state)

    checkpointer.store.write_records = recorded  # type: ignore[method-assign]

    async def scenario() -> None:
        plan = await checkpointer.restore_from(_state(tmp_path), finished={"3-0"})
        assert plan.attempts == {"0-0": 1, "1-0": 2, "2-0": 1}
        tracker.started("0-0", 1)  # only this one went out before the checkpoint
        record = await checkpointer.checkpoint()
        assert record.published, record.problem
        tracker.started("1-0", 2)
        tracker.started("2-0", 1)
        assert tracker.awaiting == {}  # dispatched: from now on they are in flight like any row

    asyncio.run(scenario())
    (commit,) = [ids for name, ids in coordinator.calls if name == "commit"]
    # The restored, undispatched 1-0 is committed at its replacement attempt (its state stays on the servers).
    assert sorted((e["rollout_id"], e["attempt"]) for e in commit) == [("0-0", 1), ("1-0", 2)]
    (published,) = written
    rows = sorted((r.rollout_id, r.attempt, r.state) for r in published.rows)
    # 2-0 (a restart, retired at attempt 0, not sent yet) is carried as it was: the next resume sends it again.
    assert rows == [("0-0", 1, "continued"), ("1-0", 2, "continued"), ("2-0", 0, "restart")]


class _NotReadyCoordinator(_CheckpointingCoordinator):
    async def prepare(self, checkpoint_id: str, **_: Any) -> Any:
        from nemo_gym_checkpoint_plugin.coordination._results import PrepareResult

        self.calls.append(("prepare", checkpoint_id))
        report = {"ready": False, "blockers": ["0-0-a1"], "blocker_count": 1, "restarts": []}
        return PrepareResult(checkpoint_id, reports={"env": report}, phases={"env": "preparing"})


def test_a_checkpoint_that_does_not_prepare_publishes_nothing_and_resumes(tmp_path: Any) -> None:
    # Issue 30: not ready by the deadline: no commit, no collector state, no manifest; the deployment resumed.
    coordinator, tracker = _NotReadyCoordinator(), RunTracker()
    (tmp_path / "ckpt").mkdir()
    checkpointer = _checkpointer(coordinator, tracker, tmp_path)
    tracker.started("0-0", 1)
    record = asyncio.run(checkpointer.checkpoint())
    assert not record.published and record.problem is not None and "not ready" in record.problem
    assert [name for name, _ in coordinator.calls] == ["prepare", "resume"]
    assert checkpointer.store.published() == [] and checkpointer.last_published_at is None
