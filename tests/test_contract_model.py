"""The model-kind contract suite, run by the built-in ``ModelCalls`` on the wheel's ``vllm_model``.

The model server is built in process (wrapped class, checkpointing enabled) and driven through
``httpx.ASGITransport``; its inference worker is the testing kit's fake backend, served by a
real uvicorn on 127.0.0.1 in this event loop, so the model server's calls to it are real HTTP
and a dropped request is seen there as a disconnect.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from control_support import wait_until
from gym_inprocess import TOKEN, InProcessServer
from nemo_gym import server_utils
from nemo_gym_checkpoint_plugin.builtin_participants.model import ModelCalls
from test_attach_inprocess import _app, _build, _config, _server_class

from nemo_gym_checkpoint_plugin.identity import EpisodeId
from nemo_gym_checkpoint_plugin.testing.contracts import MakeHarness
from nemo_gym_checkpoint_plugin.testing.contracts import model as model_contract
from nemo_gym_checkpoint_plugin.testing.fake_backend import FakeBackendState, HeldCall, create_app
from nemo_gym_checkpoint_plugin.testing.gym_config import MODEL, TOKEN_ENV
from nemo_gym_checkpoint_plugin.testing.harness import free_port_base
from nemo_gym_checkpoint_plugin.wrap import derive_checkpointable

_CALLS = itertools.count()


def same_answer(a: Any, b: Any) -> bool:
    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("id", "created_at", "call_id")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(a) == strip(b)


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
    def __init__(self, built: InProcessServer, state: FakeBackendState) -> None:
        self.built = built
        self.participant = built.participant
        self.state = state
        self.same_answer = same_answer
        self._http = httpx.AsyncClient(transport=httpx.ASGITransport(app=built.app), base_url="http://m", timeout=30)

    async def begin(self, episode: EpisodeId) -> Call:
        conversation = f"contract call {next(_CALLS)} of {episode.capture_key}"
        self.state.add_rule(conversation, 1, None)
        body = {"input": [{"role": "user", "content": conversation}], "tools": [_WEATHER]}
        task = asyncio.ensure_future(self._http.post(f"/ng-rollout/{episode.capture_key}/v1/responses", json=body))
        call = Call(self.state, conversation, task)

        def arrived() -> bool:
            call.held = next((h for h in self.state.held.values() if h.conversation == conversation), None)
            return call.held is not None

        await wait_until(arrived, timeout=20, what="the call to reach the backend")
        return call

    async def status(self) -> Mapping[str, Any]:
        return await self.built.status()

    async def aclose(self) -> None:
        await self._http.aclose()


_WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": ""}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


class TestModelCalls(model_contract.TestModelContract):
    @pytest.fixture
    async def make_harness(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MakeHarness]:
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        # Gym's data client is a process global bound to the loop that made it: one per test here.
        monkeypatch.setattr(server_utils, "_GLOBAL_AIOHTTP_CLIENT", None)
        server_utils.set_global_aiohttp_client(server_utils.GlobalAIOHTTPAsyncClientConfig())
        state = FakeBackendState()
        port = free_port_base(span=1)
        backend = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
        serving = asyncio.ensure_future(backend.serve())
        await wait_until(lambda: backend.started or serving.done(), timeout=20, what="the fake backend to serve")
        assert backend.started
        config = _config(tmp_path, {"enabled": True, "control_auth_token_env": TOKEN_ENV})
        server_class = derive_checkpointable(_server_class(config, MODEL))
        made: list[VLLMHarness] = []

        async def make() -> VLLMHarness:
            server = _build(server_class, config, MODEL, base_url=f"http://127.0.0.1:{port}/v1")
            harness = VLLMHarness(InProcessServer(server, _app(server), ModelCalls), state)
            made.append(harness)
            return harness

        yield make
        for harness in made:
            await harness.aclose()
            await harness.built.control.aclose()
        state.reset()
        client = server_utils._GLOBAL_AIOHTTP_CLIENT
        if client is not None:
            await client.close()
        backend.should_exit = True
        await serving
