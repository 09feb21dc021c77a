"""The agent-kind contract suite, run by the built-in ``SimpleAgentSessions`` on the wheel's ``simple_agent``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from gym_inprocess import GymServers, InProcessServer
from nemo_gym_checkpoint_plugin.builtin_participants.agent import SimpleAgentSessions

from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin.testing.contracts import MakeHarness
from nemo_gym_checkpoint_plugin.testing.contracts import agent as agent_contract
from nemo_gym_checkpoint_plugin.testing.gym_config import AGENT


def _session_id(episode: EpisodeId) -> str:
    return f"agent-{episode.rollout_id}"


def _wire(episode: EpisodeId) -> dict[str, Any]:
    return {"rollout_id": episode.rollout_id, "attempt": episode.attempt}


class SimpleAgentHarness:
    """Episodes are agent sessions seeded over ``/v1/agent_sessions``, with one direct tool access each."""

    def __init__(self, built: InProcessServer) -> None:
        self.built = built
        self.participant = built.participant

    async def start(self, episode: EpisodeId) -> None:
        body = {
            "agent_session_id": _session_id(episode),
            "episode_id": _wire(episode),
            "task_id": {"taskset": "contract", "task_id": episode.rollout_id},
            "tool_accesses": [
                {
                    "kind": "direct_http",
                    "name": "weather",
                    "required": True,
                    "base_url": f"http://127.0.0.1:9/ng-rollout/{episode.capture_key}",
                    "cookies": {"resources": f"cookie-{episode.rollout_id}"},
                }
            ],
        }
        reply = await self.built.post("/v1/agent_sessions", body)
        assert reply.status_code == 200, reply.text

    async def start_restart(self, episode: EpisodeId) -> None:
        raise NotImplementedError("an agent declares no restarts")

    async def finish(self, episode: EpisodeId) -> None:
        body = {"agent_session_id": _session_id(episode), "episode_id": _wire(episode)}
        reply = await self.built.post("/v1/agent_sessions/close", body)
        assert reply.status_code == 200, reply.text

    def available(self, episode: EpisodeId) -> bool:
        record = self.built.server._session_records.get(_session_id(episode))
        if record is None or record.state is None or record.closing:
            return False
        # Both the record and the seed request it holds name the attempt (the close matches on it).
        return record.episode_id == episode and record.state.request.episode_id == episode

    def bad_record(self, episode: EpisodeId) -> Mapping[str, Any]:
        return {"episode_id": _wire(episode), "request": {}}

    async def status(self) -> Mapping[str, Any]:
        return await self.built.status()


class TestSimpleAgentSessions(agent_contract.TestAgentContract):
    @pytest.fixture
    async def make_harness(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MakeHarness]:
        servers = GymServers(tmp_path, monkeypatch, AGENT)

        async def make() -> SimpleAgentHarness:
            return SimpleAgentHarness(servers.build(SimpleAgentSessions))

        yield make
        await servers.aclose()


async def test_a_restored_session_points_its_tool_access_at_the_replacement_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Simple Agent specifics beyond the kind contract: the tool base URL and cookies carry over.
    from nemo_gym_checkpoint_plugin.testing.contracts.base import _restored, _round_trip

    servers = GymServers(tmp_path, monkeypatch, AGENT)
    first = SimpleAgentHarness(servers.build(SimpleAgentSessions))
    episode = EpisodeId(rollout_id="tools", attempt=1)
    await first.start(episode)
    records = _round_trip(first.participant.export(checkpoint_id="ck", scope=None))
    second = SimpleAgentHarness(servers.build(SimpleAgentSessions))
    await second.participant.install(checkpoint_id="r", manifest={}, records=_restored(records))
    state = second.built.server._session_records[_session_id(episode)].state
    assert [str(a.base_url) for a in state.request.tool_accesses] == ["http://127.0.0.1:9/ng-rollout/tools-a2"]
    assert state.resources_cookies == {"resources": "cookie-tools"}
    await servers.aclose()
