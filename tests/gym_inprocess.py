"""Harness plumbing for the built-in participants: the wheel's real server classes, built in process.

A server is built as ``tests/test_attach_inprocess.py`` builds it (wrapped class, config from
a generated Gym config with the ``checkpoint:`` block enabled, ``setup_webserver`` +
liveness) and driven through ``httpx.ASGITransport``; its participant is the built-in
plugin the attachment registered. Each ``GymServers.build`` is a new server with empty
state, which is what a restarted process is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
from test_attach_inprocess import _app, _build, _config, _server_class

from nemo_gym_checkpoint_plugin._attach import ATTACHMENT_STATE
from nemo_gym_checkpoint_plugin.testing.gym_config import TOKEN_ENV
from nemo_gym_checkpoint_plugin.wrap import derive_checkpointable

__all__ = ["GymServers", "InProcessServer", "TOKEN"]

TOKEN = "contract-test-token"
STATUS = "/ng-control/v1/checkpoint/status"


class InProcessServer:
    """One built server: its Gym object, app, control plane and built-in participant plugin."""

    def __init__(self, server: Any, app: Any, plugin_type: type) -> None:
        self.server = server
        self.app = app
        self.control = getattr(app.state, ATTACHMENT_STATE).control
        found = [p for p in self.control.pm.get_plugins() if isinstance(p, plugin_type)]
        assert len(found) == 1, f"expected one {plugin_type.__name__} registered, found {found}"
        self.participant = found[0]

    async def post(self, path: str, body: Mapping[str, Any]) -> httpx.Response:
        # A new client per call: no session cookie carries over between episodes.
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10.0) as http:
            return await http.post(path, json=dict(body))

    async def status(self) -> Mapping[str, Any]:
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10.0) as http:
            reply = await http.get(STATUS, headers={"Authorization": f"Bearer {TOKEN}"})
        assert reply.status_code == 200, reply.text
        return reply.json()


class GymServers:
    """Builds servers named ``name`` from one generated config; closes every control plane it built."""

    def __init__(self, tmp_path: Path, monkeypatch: Any, name: str) -> None:
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        self.config = _config(tmp_path, {"enabled": True, "control_auth_token_env": TOKEN_ENV})
        self.name = name
        self.server_class = derive_checkpointable(_server_class(self.config, name))
        self.built: list[InProcessServer] = []

    def build(self, plugin_type: type) -> InProcessServer:
        server = _build(self.server_class, self.config, self.name)
        built = InProcessServer(server, _app(server), plugin_type)
        self.built.append(built)
        return built

    async def aclose(self) -> None:
        for built in self.built:
            await built.control.aclose()
