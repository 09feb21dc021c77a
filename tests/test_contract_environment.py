"""The environment-kind contract suite, run by the built-in ``EpisodeBook`` on the wheel's ``single_agent_turn``.

The server is built in process with its checkpointable run logic; its Gym client is
replaced by ``FakeGymPeers``, which answers the resources and agent calls of an episode
as those servers would and holds each agent turn (``/v1/responses``) until the test
releases it, so ``start`` leaves the episode in flight inside its agent step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from gym_fakes import FakeReply
from gym_inprocess import GymServers, InProcessServer
from nemo_gym.rollout_correlation import current_rollout_id
from nemo_gym.server_utils import ServerClient
from nemo_gym_checkpoint_plugin.builtin_participants.environment.episode_book import EpisodeBook
from pydantic import ConfigDict

from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._wire import AGENT_SESSION_HEADER, RESTART_HEADER
from nemo_gym_checkpoint_plugin.testing.contracts import MakeHarness
from nemo_gym_checkpoint_plugin.testing.contracts import environment as environment_contract
from nemo_gym_checkpoint_plugin.testing.gym_config import ENVIRONMENT, rollout_body

_BOUND_SECONDS = 10.0
_RESPONSE = {
    "id": "resp-contract",
    "created_at": 0,
    "model": "contract",
    "object": "response",
    "output": [],
    "parallel_tool_calls": False,
    "tool_choice": "auto",
    "tools": [],
}


class FakeGymPeers(ServerClient):
    """The resources and agent servers of ``single_agent_turn``, as far as one episode's calls go."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    restart_rollouts: set[str]
    in_agent_turn: set[str]
    turns: dict[str, asyncio.Event]
    # What the agent declares on its session reply ("capture", or "mid-turn").
    agent_declares: str = "capture"
    # Agent session closes received, by rollout key.
    agent_closes: list[str] = []

    async def post(self, server_name: str, url_path: str, **kwargs: Any) -> FakeReply:
        body = kwargs.get("json") or {}
        key = current_rollout_id() or "unattributed"
        if url_path == "/seed_session":
            episode = EpisodeId.model_validate(body["episode_id"])
            headers = {RESTART_HEADER: "1"} if episode.rollout_id in self.restart_rollouts else {}
            reply = {"resources_session_id": body["resources_session_id"]}
            return FakeReply(reply, headers, {"resources": f"resources-{key}"})
        if url_path == "/v1/agent_sessions":
            reply = {"agent_session_id": body["agent_session_id"]}
            return FakeReply(reply, {AGENT_SESSION_HEADER: self.agent_declares}, {"agent": f"agent-{key}"})
        if url_path.endswith("/v1/responses"):
            turn = self.turns.setdefault(key, asyncio.Event())
            self.in_agent_turn.add(key)
            try:
                await turn.wait()
            finally:
                self.in_agent_turn.discard(key)
            return FakeReply(_RESPONSE)
        if url_path == "/v1/agent_sessions/close":
            self.agent_closes.append(key)
            return FakeReply({"agent_session_id": body["agent_session_id"]})
        if url_path == "/verify":
            return FakeReply(
                {
                    "responses_create_params": body["responses_create_params"],
                    "response": body["response"],
                    "reward": 1.0,
                }
            )
        if url_path == "/close_session":
            return FakeReply({})
        raise AssertionError(f"unexpected call {server_name} {url_path}")


class SingleAgentTurnHarness:
    """Episodes are ``/run`` calls held in their agent turn; their tasks end at teardown."""

    def __init__(self, built: InProcessServer) -> None:
        self.built = built
        self.participant: EpisodeBook = built.participant
        original = built.server.server_client
        self.peers = FakeGymPeers(
            head_server_config=original.head_server_config,
            global_config_dict=original.global_config_dict,
            restart_rollouts=set(),
            in_agent_turn=set(),
            turns={},
        )
        built.server.server_client = self.peers
        self.runs: list[asyncio.Task[Any]] = []

    async def _run(self, episode: EpisodeId) -> None:
        body = rollout_body(episode.rollout_id, attempt=episode.attempt)
        run = asyncio.ensure_future(self.built.post("/run", body))
        self.runs.append(run)
        async with asyncio.timeout(_BOUND_SECONDS):
            while episode.capture_key not in self.peers.in_agent_turn:
                # A /run that ended early (refused, failed) never reaches its turn: say so at once.
                if run.done():
                    raise AssertionError(
                        f"/run of {episode.capture_key} ended before its agent turn: {run.result().text}"
                    )
                await asyncio.sleep(0.005)  # wait-ok: poll interval of a bounded wait on a condition

    async def start(self, episode: EpisodeId) -> None:
        await self._run(episode)

    async def start_restart(self, episode: EpisodeId) -> None:
        self.peers.restart_rollouts.add(episode.rollout_id)
        await self._run(episode)

    async def finish_step(self, episode: EpisodeId) -> None:
        self.peers.turns.setdefault(episode.capture_key, asyncio.Event()).set()

    def available(self, episode: EpisodeId) -> bool:
        key = episode.capture_key
        return key in self.participant._episodes or key in self.participant._restored

    def bad_record(self, episode: EpisodeId) -> Mapping[str, Any]:
        return {
            "episode_id": {"rollout_id": episode.rollout_id, "attempt": episode.attempt},
            "boundary": "seeded",
            "state": {},
        }

    async def status(self) -> Mapping[str, Any]:
        return await self.built.status()

    async def aclose(self) -> None:
        for task in self.runs:
            task.cancel()
        await asyncio.gather(*self.runs, return_exceptions=True)


class TestSingleAgentTurnEpisodes(environment_contract.TestEnvironmentContract):
    @pytest.fixture
    async def make_harness(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MakeHarness]:
        servers = GymServers(tmp_path, monkeypatch, ENVIRONMENT)
        made: list[SingleAgentTurnHarness] = []

        async def make() -> SingleAgentTurnHarness:
            made.append(SingleAgentTurnHarness(servers.build(EpisodeBook)))
            return made[-1]

        yield make
        for harness in made:
            await harness.aclose()
        await servers.aclose()


async def test_retired_attempt_that_got_past_the_gate_never_begins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The marks are checked where the episode begins too: a gate bypass still cannot run a retired attempt."""
    import nemo_gym_checkpoint_plugin._gate as gate_module

    servers = GymServers(tmp_path, monkeypatch, ENVIRONMENT)
    harness = SingleAgentTurnHarness(servers.build(EpisodeBook))
    try:
        # A gate that cannot attribute any /run body: the request reaches the run logic.
        monkeypatch.setattr(gate_module, "attempt_from_run_body", lambda _body: None)
        harness.built.control.marks.mark("r", 0)
        reply = await asyncio.wait_for(harness.built.post("/run", rollout_body("r", attempt=0)), _BOUND_SECONDS)
        assert reply.status_code == 409, reply.text
        assert reply.json()["error"]["code"] == "stale_attempt"
        assert harness.built.server.server_client is harness.peers and not harness.peers.turns
        assert harness.participant.status_fields()["episodes"] == 0
        assert harness.built.app.state.ng_checkpoint_gate.refused == 0  # refused past the gate, not by it
        # The next attempt begins as usual.
        await harness.start(EpisodeId(rollout_id="r", attempt=1))
    finally:
        await harness.aclose()
        await servers.aclose()


async def test_an_agent_step_delegated_to_a_mid_turn_agent_never_blocks_and_closes_only_after_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """wait mode: the agent captures the turn itself, so it never blocks; the env parks before the close."""
    from nemo_gym_checkpoint_plugin.testing.contracts import call_hook
    from nemo_gym_checkpoint_plugin.testing.contracts.base import _export, _restored, _round_trip

    servers = GymServers(tmp_path, monkeypatch, ENVIRONMENT)
    harness = SingleAgentTurnHarness(servers.build(EpisodeBook))
    harness.peers.agent_declares = "mid-turn"
    episode = EpisodeId(rollout_id="delegated", attempt=0)
    try:
        assert harness.participant.step_mode.value == "wait"
        await harness.start(episode)
        await call_hook(harness.participant, "close_admission", checkpoint_id="ck-1")
        readiness = await call_hook(harness.participant, "ready", checkpoint_id="ck-1")
        assert list(readiness.blockers) == []
        # The turn replies while the checkpoint is open: the episode parks before closing the agent session.
        await harness.finish_step(episode)
        async with asyncio.timeout(_BOUND_SECONDS):
            while harness.participant.ready(checkpoint_id="ck-1").counts["parked"] != 1:
                await asyncio.sleep(0.005)  # wait-ok: poll interval of a bounded wait on a condition
        assert harness.peers.agent_closes == []
        (record,) = _round_trip(await _export(harness, None))
        assert record["boundary"] == "seeded" and record["state"]["agent_mid_turn"] is True
        restored = SingleAgentTurnHarness(servers.build(EpisodeBook))
        await call_hook(restored.participant, "install", checkpoint_id="r-1", manifest={}, records=_restored([record]))
        assert restored.available(EpisodeId(rollout_id="delegated", attempt=1))
        await call_hook(harness.participant, "open_admission", checkpoint_id="ck-1")
        reply = await asyncio.wait_for(harness.runs[0], _BOUND_SECONDS)
        assert reply.status_code == 200 and reply.json()["result"]["reward"] == 1.0, reply.text
        assert harness.peers.agent_closes == [episode.capture_key]
        await restored.aclose()
    finally:
        await harness.aclose()
        await servers.aclose()


async def test_a_replacement_run_carrying_another_task_is_refused_409_task_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30, over Gym's /run: the record keeps the task's digest; another task never continues it."""
    from nemo_gym_checkpoint_plugin.testing.contracts import call_hook
    from nemo_gym_checkpoint_plugin.testing.contracts.base import _export, _restored, _round_trip

    servers = GymServers(tmp_path, monkeypatch, ENVIRONMENT)
    harness = SingleAgentTurnHarness(servers.build(EpisodeBook))
    restored = SingleAgentTurnHarness(servers.build(EpisodeBook))
    try:
        await harness.start(EpisodeId(rollout_id="t", attempt=0))
        (record,) = _round_trip(await _export(harness, None))
        assert record["boundary"] == "seeded" and len(record["task_digest"]) == 64
        await call_hook(restored.participant, "install", checkpoint_id="r-1", manifest={}, records=_restored([record]))
        other = rollout_body("t", attempt=1, prompt="another task's prompt")
        reply = await asyncio.wait_for(restored.built.post("/run", other), _BOUND_SECONDS)
        assert reply.status_code == 409, reply.text
        error = reply.json()["error"]
        assert error["code"] == "task_mismatch" and error["episode_ids"] == ["t-a1"] and "t-a1" in error["detail"]
        assert restored.participant.restored_pending() == ["t-a1"] and not restored.peers.in_agent_turn
        # The /run carrying the checkpointed task continues the restored boundary.
        await restored.start(EpisodeId(rollout_id="t", attempt=1))
        assert restored.participant.restored_pending() == []
    finally:
        await restored.aclose()
        await harness.aclose()
        await servers.aclose()
