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


async def test_a_retire_stops_the_attempts_requests_in_flight_before_it_replies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 30: a retire dropped the bindings but left /verify and tool calls running, so they could reply
    # after the retire. Now it cancels them (a refusal 409 stale_attempt) and waits for them; another
    # rollout's request is untouched.
    import asyncio
    import time

    from resources_servers.example_single_tool_call.app import GetWeatherRequest, GetWeatherResponse

    servers = GymServers(tmp_path, monkeypatch, RESOURCES)
    entered: list[str] = []
    release = asyncio.Event()

    async def held(self: Any, body: GetWeatherRequest) -> GetWeatherResponse:
        entered.append(body.city)
        await release.wait()
        return GetWeatherResponse(city=body.city, weather_description="late")

    # FastAPI reads the body model from the annotations (strings here: this module's future import).
    held.__annotations__ = {"self": Any, "body": GetWeatherRequest, "return": GetWeatherResponse}
    monkeypatch.setattr(servers.server_class, "get_weather", held)
    monkeypatch.setattr(servers.server_class, "verify", held)
    built = servers.build(ResourcesSessions)
    try:
        harness = ResourcesHarness(built)
        retired, other = EpisodeId(rollout_id="r", attempt=0), EpisodeId(rollout_id="o", attempt=0)
        await harness.start(retired)
        calls = {
            "r-tool": asyncio.create_task(built.post("/ng-rollout/r/get_weather", {"city": "r-tool"})),
            "r-verify": asyncio.create_task(built.post("/ng-rollout/r/verify", {"city": "r-verify"})),
            "o-tool": asyncio.create_task(built.post("/ng-rollout/o/get_weather", {"city": "o-tool"})),
        }
        deadline = time.monotonic() + 10
        while len(entered) < 3:
            done = {n: c.result().text for n, c in calls.items() if c.done()}
            assert time.monotonic() < deadline, f"requests in flight: {entered}, answered: {done}"
            await asyncio.sleep(0.005)  # wait-ok: polling a bounded condition
        reply = await built.control.retire("ret-1", time.time() + 10, [retired])
        assert reply == {"retired_count": 1}
        # Nothing of the retired attempt still runs here once the retire replied.
        assert calls["r-tool"].done() and calls["r-verify"].done() and not calls["o-tool"].done()
        for name in ("r-tool", "r-verify"):
            refused = calls[name].result()
            assert refused.status_code == 409 and refused.json()["error"]["code"] == "stale_attempt", refused.text
            assert "episode r " in refused.json()["error"]["detail"]
        assert not harness.available(retired)
        release.set()
        answered = await calls["o-tool"]
        assert answered.status_code == 200 and answered.json()["weather_description"] == "late"
        assert harness.available(other) is False  # never seeded: only its tool call ran
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
        await built.participant.retire(episode_ids=[EpisodeId(rollout_id="tools", attempt=0)])
        assert built.participant.export(checkpoint_id="ck2", scope=None).reply_extras == {
            "answered_tool_calls": {"tools-a1": 1}
        }
    finally:
        await servers.aclose()
