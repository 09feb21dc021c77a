"""The agent's install builds its sessions with the garbage collector paused, and always gives it back."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from gym_inprocess import GymServers
from nemo_gym_checkpoint_plugin.builtin_participants.agent.open_sessions import SimpleAgentSessions
from test_contract_agent import SimpleAgentHarness

from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._types import RestoredRecord, plain_records
from nemo_gym_checkpoint_plugin.testing.gym_config import AGENT


@pytest.fixture
async def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[GymServers]:
    built = GymServers(tmp_path, monkeypatch, AGENT)
    try:
        yield built
    finally:
        await built.aclose()


@pytest.fixture(autouse=True)
def _gc_back() -> Iterator[None]:
    yield
    gc.enable()


async def _restored(servers: GymServers, count: int) -> list[RestoredRecord]:
    first = SimpleAgentHarness(servers.build(SimpleAgentSessions))
    for index in range(count):
        await first.start(EpisodeId(rollout_id=f"r{index}"))
    exported = orjson.loads(orjson.dumps(plain_records(first.participant.export(checkpoint_id="c1", scope=None))))
    out = []
    for record in exported:
        checkpointed = EpisodeId.model_validate(record["episode_id"])
        out.append(RestoredRecord(checkpointed, EpisodeId(rollout_id=checkpointed.rollout_id, attempt=1), record))
    return out


async def test_gc_is_off_while_each_session_is_built(servers: GymServers, monkeypatch: pytest.MonkeyPatch) -> None:
    records = await _restored(servers, 5)
    second = SimpleAgentHarness(servers.build(SimpleAgentSessions))
    server_class = type(second.built.server)
    original = server_class._seed_agent_session_state
    gc_on: list[bool] = []

    async def seeding(self: Any, body: Any) -> Any:
        gc_on.append(gc.isenabled())
        return await original(self, body)

    monkeypatch.setattr(server_class, "_seed_agent_session_state", seeding)
    await second.participant.install(checkpoint_id="c1", manifest={}, records=records)
    assert gc_on == [False] * 5 and gc.isenabled()
    assert sorted(second.participant.restored_pending()) == sorted(f"r{i}-a1" for i in range(5))


async def test_a_refused_install_gives_gc_back_and_a_disabled_one_stays_disabled(
    servers: GymServers,
) -> None:
    records = await _restored(servers, 3)
    bad = RestoredRecord(records[1].checkpointed, records[1].replacement, {**records[1].record, "agent_session_id": ""})
    second = SimpleAgentHarness(servers.build(SimpleAgentSessions))
    with pytest.raises(ValueError, match="agent_session_id"):
        await second.participant.install(checkpoint_id="c1", manifest={}, records=[records[0], bad])
    assert gc.isenabled()
    gc.disable()
    await second.participant.install(checkpoint_id="c1", manifest={}, records=records)
    assert not gc.isenabled()
