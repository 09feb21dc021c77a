"""The resources-kind contract suite, run by the built-in ``ResourcesSessions`` on ``example_single_tool_call``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from gym_inprocess import GymServers, InProcessServer
from nemo_gym_checkpoint_plugin.builtin_participants.resources.session_bindings import (
    RESTART_TASK_KEY,
    ResourcesSessions,
)

from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin.testing.contracts import MakeHarness
from nemo_gym_checkpoint_plugin.testing.contracts import resources as resources_contract
from nemo_gym_checkpoint_plugin.testing.gym_config import RESOURCES


def _session_id(episode: EpisodeId) -> str:
    return f"res-{episode.rollout_id}"


def _wire(episode: EpisodeId) -> dict[str, Any]:
    return {"rollout_id": episode.rollout_id, "attempt": episode.attempt}


class ResourcesHarness:
    """Episodes are resources sessions seeded over ``/seed_session`` (the seed hook runs from the reply)."""

    def __init__(self, built: InProcessServer) -> None:
        self.built = built
        self.participant = built.participant

    async def _seed(self, episode: EpisodeId, task_data: dict[str, Any]) -> None:
        body = {
            "resources_session_id": _session_id(episode),
            "episode_id": _wire(episode),
            "task_id": {"taskset": "contract", "task_id": episode.rollout_id},
            "task_data": task_data,
        }
        reply = await self.built.post("/seed_session", body)
        assert reply.status_code == 200, reply.text

    async def start(self, episode: EpisodeId) -> None:
        await self._seed(episode, {})

    async def start_restart(self, episode: EpisodeId) -> None:
        await self._seed(episode, {RESTART_TASK_KEY: "restart"})

    async def finish(self, episode: EpisodeId) -> None:
        body = {"resources_session_id": _session_id(episode), "episode_id": _wire(episode)}
        reply = await self.built.post("/close_session", body)
        assert reply.status_code == 200, reply.text

    def available(self, episode: EpisodeId) -> bool:
        binding = self.built.server._session_episodes.get(_session_id(episode))
        return binding is not None and binding[0] == episode

    def bad_record(self, episode: EpisodeId) -> Mapping[str, Any]:
        return {"episode_id": _wire(episode), "task_id": {"taskset": "contract", "task_id": "x"}}

    async def status(self) -> Mapping[str, Any]:
        return await self.built.status()


class TestResourcesSessions(resources_contract.TestResourcesContract):
    @pytest.fixture
    async def make_harness(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MakeHarness]:
        servers = GymServers(tmp_path, monkeypatch, RESOURCES)

        async def make() -> ResourcesHarness:
            return ResourcesHarness(servers.build(ResourcesSessions))

        yield make
        await servers.aclose()


async def test_tool_calls_are_counted_per_rollout_and_session_routes_are_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    servers = GymServers(tmp_path, monkeypatch, RESOURCES)
    built = servers.build(ResourcesSessions)
    try:
        for key in ("tools", "tools", "tools-a1", "other"):
            reply = await built.post(f"/ng-rollout/{key}/get_weather", {"city": "San Francisco"})
            assert reply.status_code == 200, reply.text
        await built.post("/ng-rollout/tools/verify", {})  # a session route, whatever it replies
        status = await built.status()
        # Attempts of one rollout add up: a tool call run again after a restore shows as a count above one.
        assert status["tool_calls_by_rollout"] == {"tools": 3, "other": 1}
    finally:
        await servers.aclose()


async def test_the_commit_reply_counts_answered_tool_calls_per_episode_until_forgotten_or_retired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    servers = GymServers(tmp_path, monkeypatch, RESOURCES)
    built = servers.build(ResourcesSessions)
    try:
        for key in ("tools", "tools", "tools-a1", "other"):
            reply = await built.post(f"/ng-rollout/{key}/get_weather", {"city": "San Francisco"})
            assert reply.status_code == 200, reply.text
        refused = await built.post("/ng-rollout/bad/get_weather", {"no_city": 1})  # not answered: Gym's 422
        assert refused.status_code == 422
        await built.post("/ng-rollout/tools/verify", {})  # a session route, never a tool call
        exported = built.participant.export(checkpoint_id="ck", scope=frozenset())
        assert list(exported.records) == []  # the scope is empty; the counts name every episode all the same
        assert exported.reply_extras == {"answered_tool_calls": {"tools": 2, "tools-a1": 1, "other": 1}}
        built.participant.forgotten(rollout_ids=["other"])
        built.participant.retire(episode_ids=[EpisodeId(rollout_id="tools", attempt=0)])
        assert built.participant.export(checkpoint_id="ck2", scope=None).reply_extras == {
            "answered_tool_calls": {"tools-a1": 1}
        }
    finally:
        await servers.aclose()
