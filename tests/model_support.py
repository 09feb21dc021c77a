"""In-process ``vllm_model`` servers (wrapped, checkpointing on) in front of the fake backend served over real HTTP.

The fake backend runs under a real uvicorn on 127.0.0.1 in the test's event loop, so the model
server's calls to it are real HTTP (a dropped request is a disconnect there); each model server
is built as a restarted process would be (empty state), from one generated Gym config.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from control_support import wait_until
from gym_inprocess import TOKEN, InProcessServer
from nemo_gym import server_utils
from nemo_gym_checkpoint_plugin.builtin_participants.model.calls import ModelCalls
from omegaconf import OmegaConf
from test_attach_inprocess import _app, _build, _server_class

from nemo_gym_checkpoint_plugin.testing.fake_backend import FakeBackendState, create_app
from nemo_gym_checkpoint_plugin.testing.gym_config import MODEL, TOKEN_ENV, build_gym_config
from nemo_gym_checkpoint_plugin.testing.harness import free_port_base
from nemo_gym_checkpoint_plugin.wrap import derive_checkpointable

__all__ = ["AUTH", "ModelServers", "WEATHER_TOOL", "same_answer"]

AUTH = {"Authorization": f"Bearer {TOKEN}"}
WEATHER_TOOL = {
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


def same_answer(a: Any, b: Any) -> bool:
    """Two replies to the same request are the same answer (generated ids and timestamps aside)."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("id", "created_at", "call_id")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(a) == strip(b)


class ModelServers:
    """The fake backend (``state``) and every ``vllm_model`` built against it; ``aclose`` stops them all."""

    def __init__(
        self, tmp_path: Path, monkeypatch: Any, extra_config: Mapping[str, Any] | None = None, replicas: int = 1
    ) -> None:
        # Where the fake backend stages calls admitted for external token staging (the framework's storage).
        self.staging_dir = tmp_path / "staged"
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        # Gym's data client is a process global bound to the loop that made it: one per test here.
        monkeypatch.setattr(server_utils, "_GLOBAL_AIOHTTP_CLIENT", None)
        self.state = FakeBackendState()
        self.port = free_port_base(span=1)
        checkpoint = {"enabled": True, "control_auth_token_env": TOKEN_ENV}
        # Replicas: more model servers (policy_model_2, ...) in the same config, sharing its capture directory.
        self.config = build_gym_config(20000, tmp_path, checkpoint=checkpoint, replicas=replicas)
        for key, value in (extra_config or {}).items():
            self.config[key] = OmegaConf.create(value) if isinstance(value, Mapping) else value
        self.server_class = derive_checkpointable(_server_class(self.config, MODEL))
        self.built: list[tuple[InProcessServer, httpx.AsyncClient]] = []
        self._backend: uvicorn.Server | None = None
        self._serving: asyncio.Future[None] | None = None

    async def start(self, **backend: Any) -> None:
        """Serve the fake backend (``backend``: more ``create_app`` options, e.g. ``reasoning_parser``)."""
        server_utils.set_global_aiohttp_client(server_utils.GlobalAIOHTTPAsyncClientConfig())
        app = create_app(self.state, staging_dir=self.staging_dir, **backend)
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self._backend = uvicorn.Server(config)
        self._serving = asyncio.ensure_future(self._backend.serve())
        backend = self._backend
        await wait_until(lambda: backend.started or self._serving.done(), timeout=20, what="the fake backend")
        assert backend.started

    def build(self, name: str = MODEL, **overrides: Any) -> tuple[InProcessServer, httpx.AsyncClient]:
        """A fresh model server ``name`` (a new process after a crash) and a client of its app."""
        server = _build(self.server_class, self.config, name, base_url=f"http://127.0.0.1:{self.port}/v1", **overrides)
        built = InProcessServer(server, _app(server), ModelCalls)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=built.app), base_url="http://model", timeout=30)
        self.built.append((built, http))
        return built, http

    async def aclose(self) -> None:
        for built, http in self.built:
            await http.aclose()
            await built.control.aclose()
        self.state.reset()
        client = server_utils._GLOBAL_AIOHTTP_CLIENT
        if client is not None:
            await client.close()
        if self._backend is not None and self._serving is not None:
            self._backend.should_exit = True
            await self._serving
