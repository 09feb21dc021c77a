"""The agent participant dumps each session's seed request once (at its seed) and reuses it in exports.

A dump is kept per session with the request object it was made from: a request replaced since
is dumped again, and the dumps of sessions that closed or left the server are forgotten.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from gym_inprocess import GymServers
from nemo_gym.base_responses_api_agent import AgentSeedSessionRequest
from nemo_gym_checkpoint_plugin.builtin_participants.agent.open_sessions import SimpleAgentSessions
from test_contract_agent import SimpleAgentHarness

from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._storage.codec import encode_line
from nemo_gym_checkpoint_plugin._types import plain_records
from nemo_gym_checkpoint_plugin.testing.gym_config import AGENT


@pytest.fixture
async def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[SimpleAgentHarness]:
    servers = GymServers(tmp_path, monkeypatch, AGENT)
    try:
        yield SimpleAgentHarness(servers.build(SimpleAgentSessions))
    finally:
        await servers.aclose()


def _export(agent: SimpleAgentHarness) -> dict[str, dict[str, Any]]:
    return {r["agent_session_id"]: r for r in plain_records(agent.participant.export(checkpoint_id="c1", scope=None))}


def _state(agent: SimpleAgentHarness, episode: EpisodeId) -> Any:
    return agent.built.server._session_records[f"agent-{episode.rollout_id}"].state


async def test_an_export_after_the_seed_dumps_no_seed_request(
    agent: SimpleAgentHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    episodes = [EpisodeId(rollout_id=f"r{i}") for i in range(3)]
    for episode in episodes:
        await agent.start(episode)
    dumps: list[Any] = []
    original = AgentSeedSessionRequest.model_dump

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        dumps.append(self.agent_session_id)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(AgentSeedSessionRequest, "model_dump", counting)
    exported = _export(agent)
    assert dumps == []  # each was dumped on its seed's reply path
    for episode in episodes:
        request = _state(agent, episode).request
        dumped = exported[f"agent-{episode.rollout_id}"]["request"]
        # The request's JSON dump, its fields left at their None default left out (they validate back as None).
        assert request.sandbox_access is None and "sandbox_access" not in dumped
        assert dumped == {k: v for k, v in original(request, mode="json").items() if k != "sandbox_access"}
        assert AgentSeedSessionRequest.model_validate(dumped) == request


async def test_an_exported_session_without_observations_writes_no_null(agent: SimpleAgentHarness) -> None:
    """No ``null`` in the record's line: the checkpoint writer walks only lines holding one for NaN."""
    episode = EpisodeId(rollout_id="r1")
    await agent.start(episode)
    (record,) = plain_records(agent.participant.export(checkpoint_id="c1", scope=None))
    assert "observations" not in record and b"null" not in encode_line(record)


async def test_a_replaced_seed_request_is_dumped_again(agent: SimpleAgentHarness) -> None:
    episode = EpisodeId(rollout_id="r1")
    await agent.start(episode)
    assert _export(agent)["agent-r1"]["request"]["task_id"]["task_id"] == "r1"
    state = _state(agent, episode)
    task_id = state.request.task_id.model_copy(update={"task_id": "t2"})
    state.request = state.request.model_copy(update={"task_id": task_id})
    assert _export(agent)["agent-r1"]["request"]["task_id"]["task_id"] == "t2"


async def test_the_dumps_of_closed_sessions_are_forgotten(agent: SimpleAgentHarness) -> None:
    episodes = [EpisodeId(rollout_id=f"r{i}") for i in range(3)]
    for episode in episodes:
        await agent.start(episode)
    await agent.finish(episodes[0])
    await agent.participant.retire([episodes[1]])
    assert set(_export(agent)) == {"agent-r2"}
    assert set(agent.participant._dumps) == {"agent-r2"}
