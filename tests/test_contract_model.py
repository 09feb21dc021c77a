"""The model-kind contract suite, run by the built-in ``ModelCalls`` on the wheel's ``vllm_model``.

The model server is built in process and driven through ``httpx.ASGITransport``; its inference
worker is the testing kit's fake backend over real HTTP (``model_support.ModelServers``), so a
dropped request is seen there as a disconnect.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from control_support import wait_until
from gym_inprocess import InProcessServer
from model_support import WEATHER_TOOL, ModelServers, same_answer

from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin.testing.contracts import MakeHarness
from nemo_gym_checkpoint_plugin.testing.contracts import model as model_contract
from nemo_gym_checkpoint_plugin.testing.fake_backend import FakeBackendState, HeldCall

_CALLS = itertools.count()


class Call:
    """One model call held at the fake backend until ``finish``."""

    def __init__(self, state: FakeBackendState, conversation: str, task: asyncio.Task[httpx.Response]) -> None:
        self.state = state
        self.conversation = conversation
        self.task = task
        self.held: HeldCall | None = None

    async def finish(self) -> None:
        assert self.state.release(self.conversation) == 1

    def done(self) -> bool:
        return self.task.done()

    async def reply(self) -> tuple[int, Mapping[str, Any]]:
        response = await self.task
        return response.status_code, response.json()

    async def dropped(self) -> bool:
        held = self.held
        assert held is not None
        await wait_until(lambda: held.call_id not in self.state.held, what="the backend to see the request dropped")
        return not self.state.completed.get(self.conversation)


class VLLMHarness:
    def __init__(self, built: InProcessServer, http: httpx.AsyncClient, state: FakeBackendState) -> None:
        self.built = built
        self.participant = built.participant
        self.state = state
        self.same_answer = same_answer
        self._http = http

    async def begin(self, episode: EpisodeId) -> Call:
        conversation = f"contract call {next(_CALLS)} of {episode.capture_key}"
        self.state.add_rule(conversation, 1, None)
        body = {"input": [{"role": "user", "content": conversation}], "tools": [WEATHER_TOOL]}
        task = asyncio.ensure_future(self._http.post(f"/ng-rollout/{episode.capture_key}/v1/responses", json=body))
        call = Call(self.state, conversation, task)

        def arrived() -> bool:
            call.held = next((h for h in self.state.held.values() if h.conversation == conversation), None)
            return call.held is not None

        await wait_until(arrived, timeout=20, what="the call to reach the backend")
        return call

    async def status(self) -> Mapping[str, Any]:
        return await self.built.status()


class TestModelCalls(model_contract.TestModelContract):
    @pytest.fixture
    async def make_harness(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MakeHarness]:
        servers = ModelServers(tmp_path, monkeypatch)
        await servers.start()

        async def make() -> VLLMHarness:
            built, http = servers.build()
            return VLLMHarness(built, http, servers.state)

        yield make
        await servers.aclose()
