"""No silent loss: an agent's ``/run`` (and an environment without steps) on a real, in-process ``simple_agent``.

The agent is the wheel's class, wrapped and attached as a deployment would; its Gym client
is replaced by a fake resources server that holds ``/seed_session`` until the test
releases it, so an episode stays in flight inside the agent's ``/run``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from control_support import wait_until
from gym_fakes import FakeReply
from gym_inprocess import GymServers, InProcessServer
from nemo_gym.server_utils import ServerClient
from nemo_gym_checkpoint_plugin.builtin_participants import builtin_plugins
from nemo_gym_checkpoint_plugin.builtin_participants.environment.episode_book import EpisodeBook
from nemo_gym_checkpoint_plugin.builtin_participants.shared.uncaptured_runs import UncapturedRuns
from pydantic import ConfigDict

from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._plugins import attach_plugins, make_plugin_manager
from nemo_gym_checkpoint_plugin._settings import CheckpointSettings
from nemo_gym_checkpoint_plugin.testing.gym_config import AGENT

_BOUND = 10.0
_PARAMS = {"input": "hello"}


class HeldResources(ServerClient):
    """The agent's resources server: each ``/seed_session`` waits until its rollout is released."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    seeding: list[str]
    release: asyncio.Event
    cleaned: list[str]

    async def post(self, server_name: str, url_path: str, **kwargs: Any) -> FakeReply:
        if url_path == "/seed_session":
            key = "seed"
            self.seeding.append(key)
            try:
                await self.release.wait()
            finally:
                self.cleaned.append(key)  # the episode's own unwinding ran to its end
            return FakeReply({})
        raise AssertionError(f"unexpected call {server_name} {url_path}")


@pytest.fixture
async def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[InProcessServer, Any]]:
    servers = GymServers(tmp_path, monkeypatch, AGENT)
    built = servers.build(UncapturedRuns)
    original = built.server.server_client
    built.server.server_client = HeldResources(
        head_server_config=original.head_server_config,
        global_config_dict=original.global_config_dict,
        seeding=[],
        release=asyncio.Event(),
        cleaned=[],
    )
    yield built, built.server.server_client
    await servers.aclose()


def _http(built: InProcessServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=built.app), base_url="http://test", timeout=_BOUND)


def _deadline() -> float:
    return time.time() + _BOUND


async def test_agent_run_without_a_rollout_id_is_refused(agent: tuple[InProcessServer, Any]) -> None:
    built, peers = agent
    async with _http(built) as http:
        for content in (b'{"responses_create_params": {"input": "hi"}}', '{"x": 1}'.encode("utf-16")):
            reply = await asyncio.wait_for(
                http.post("/run", content=content, headers={"content-type": "application/json"}), _BOUND
            )
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["code"] == "rollout_id_required"
        # Not a JSON object: nothing to attribute, the agent's own validation answers.
        reply = await asyncio.wait_for(http.post("/run", content=b"[1]"), _BOUND)
        assert reply.status_code == 422
    assert peers.seeding == []


async def test_agent_run_is_a_restart_never_blocking_and_retire_stops_it(agent: tuple[InProcessServer, Any]) -> None:
    built, peers = agent
    control = built.control
    async with _http(built) as http:
        run = asyncio.ensure_future(http.post("/run", json={"_ng_rollout_id": "r", "responses_create_params": _PARAMS}))
        await wait_until(lambda: peers.seeding == ["seed"] or run.done(), what="the agent's /run in flight")
        assert not run.done(), run.result().text
        assert (await built.status())["report"]["restarts"] == ["r"]

        prepared = await control.prepare("c1", _deadline())
        assert prepared["phase"] == "prepared"
        assert prepared["report"]["ready"] is True and prepared["report"]["restarts"] == ["r"]
        assert not hasattr(built.participant, "export")  # nothing of it can be exported
        await control.resume("c1", _deadline())

        # Retire stops the episode once and waits for it; its /run answers stale_attempt.
        assert await control.retire("op", _deadline(), [EpisodeId(rollout_id="r", attempt=0)]) == {"retired_count": 1}
        assert peers.cleaned == ["seed"]
        reply = await asyncio.wait_for(run, _BOUND)
        assert reply.status_code == 409 and reply.json()["error"]["code"] == "stale_attempt"
        assert (await built.status())["report"]["restarts"] == []

        # The retired attempt is refused before it runs again; the next one runs.
        again = await http.post("/run", json={"_ng_rollout_id": "r", "responses_create_params": _PARAMS})
        assert again.status_code == 409 and again.json()["error"]["code"] == "stale_attempt"
        peers.release.set()
        assert peers.seeding == ["seed"]


def test_an_environment_without_steps_lists_its_runs_as_restarts() -> None:
    class UnknownRunLogic:  # an environment server class the plugin has no steps for
        pass

    pm = make_plugin_manager(builtin_plugins(), load_entry_points=False)
    settings = CheckpointSettings(enabled=True)
    attach_plugins(pm, server=UnknownRunLogic(), app=None, kind="environment", instance="env", settings=settings)
    (plugin,) = [p for p in pm.get_plugins() if isinstance(p, UncapturedRuns | EpisodeBook)]
    assert isinstance(plugin, UncapturedRuns) and plugin.kind == "environment"
    assert "every /run episode is a restart" in (plugin.restart_warning or "")
