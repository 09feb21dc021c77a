"""A Gym server built in this process as a checkpoint participant, driven over HTTP without a socket.

For a participant plugin's tests (the contract suites' ``make_harness``): ``build_server`` takes
your server class and its config block, derives the checkpointable class the wrapper would run
(``wrap.derive_checkpointable``), builds it with a Gym config whose ``checkpoint:`` block is
enabled, and calls its ``setup_webserver``: the full attachment runs, so your plugin is loaded
from the ``nemo_gym_checkpoint`` entry-point group exactly as a real server loads it (and
``attach`` sees this server). Each call is a new server with empty state: what a process that
restarts after a crash is.

``InProcessServer`` gives the Gym ``server``, its ``app``, ``plugin(name)`` (a registered
plugin, e.g. yours by its entry-point name), ``client()`` (an ``httpx.AsyncClient`` over
``httpx.ASGITransport``, keeping Gym's session cookie) and ``status()`` (the control plane's
``status`` reply). ``pytest_plugin`` offers it as the ``participant_servers`` fixture. Needs httpx.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["InProcessServer", "build_server"]

STATUS = "/ng-control/v1/checkpoint/status"
_KIND_KEYS = {
    "resources": "resources_servers",
    "agent": "responses_api_agents",
    "environment": "environment_servers",
    "model": "responses_api_models",
}


class InProcessServer:
    """One built server: its Gym object, app and control plane (see the module docstring)."""

    def __init__(self, server: Any, app: Any, token: str) -> None:
        from nemo_gym_checkpoint_plugin._attach import ATTACHMENT_STATE

        self.server = server
        self.app = app
        self.token = token
        attachment = getattr(app.state, ATTACHMENT_STATE, None)
        if attachment is None:
            raise RuntimeError("the server did not become a participant (is the checkpoint block enabled?)")
        self.control = attachment.control

    def plugin(self, name: str) -> Any:
        """The plugin registered under ``name`` (an entry-point plugin's name); ``LookupError`` if absent."""
        found = self.control.pm.get_plugin(name)
        if found is None:
            raise LookupError(
                f"no checkpoint plugin named {name!r} on this server; registered: "
                f"{sorted(n for n, _p in self.control.pm.list_name_plugin())}"
            )
        return found

    def client(self, cookies: Any = None) -> Any:
        import httpx

        transport = httpx.ASGITransport(app=self.app)
        return httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10.0, cookies=cookies)

    async def status(self) -> Mapping[str, Any]:
        async with self.client() as http:
            reply = await http.get(STATUS, headers={"Authorization": f"Bearer {self.token}"})
        reply.raise_for_status()
        return reply.json()

    async def aclose(self) -> None:
        await self.control.aclose()


def build_server(
    server_class: type,
    *,
    name: str,
    kind: str = "resources",
    block: Mapping[str, Any] | None = None,
    checkpoint: Mapping[str, Any] | None = None,
    token_env: str = "NG_CHECKPOINT_TOKEN",
) -> InProcessServer:
    """Build ``server_class`` as the server ``name`` of ``kind`` with ``block`` as its config block.

    ``checkpoint`` is added to the enabled ``checkpoint:`` block (``control_auth_token_env`` is
    ``token_env``, which must be set in the environment).
    """
    from nemo_gym.server_utils import BaseServerConfig, ServerClient
    from omegaconf import OmegaConf

    from nemo_gym_checkpoint_plugin.wrap import derive_checkpointable

    derived = derive_checkpointable(server_class)
    inner = {"host": "127.0.0.1", "port": 1, "entrypoint": "app.py", "domain": "other", **(block or {})}
    global_config = OmegaConf.create(
        {
            name: {_KIND_KEYS[kind]: {name: inner}},
            "checkpoint": {"enabled": True, "control_auth_token_env": token_env, **(checkpoint or {})},
            "head_server": {"host": "127.0.0.1", "port": 2},
        }
    )
    head = BaseServerConfig(host="127.0.0.1", port=2)
    client = ServerClient(head_server_config=head, global_config_dict=global_config)
    config_cls = derived.model_fields["config"].annotation
    server = derived(config=config_cls.model_validate({**inner, "name": name}), server_client=client)
    app = server.setup_webserver()
    server.setup_liveness(app)
    return InProcessServer(server, app, os.environ.get(token_env, ""))
