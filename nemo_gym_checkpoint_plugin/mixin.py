"""``CheckpointMixin``: make a Gym server class a checkpoint participant.

Put it first among the bases of a server you write::

    class MyServer(CheckpointMixin, SimpleResourcesServer):
        ...

    if __name__ == "__main__":
        MyServer.run_webserver()

With the ``checkpoint:`` block absent or ``enabled: false`` the server behaves exactly
as without the mixin: same routes, same middleware, same client (nothing is installed).
Always, whatever the block says:

- Ray stays off (``ray_enabled = False``) unless the class itself declares otherwise;
- the block is validated before the server builds anything: a bad block (or, enabled,
  a storage backend no plugin provides) makes ``run_webserver`` exit with status 2 and
  a message naming the server and the key; so does a server
  config checkpointing does not support yet (``expose_tools_over_mcp: true`` with the
  block enabled: the message names both keys);
- Gym's session cookie name and secret are those of the class the mixin was added to
  (``get_session_middleware_key`` is inherited untouched, and the wrapper's derived
  classes keep the base's name).

When enabled: the plugin's server client is installed before the server's own
``setup_webserver()`` runs, then ``attach_checkpointing`` adds the control routes and
the admission gate to the app it built. An agent also reports the capture key of a
plain ``/run`` body as its rollout id (Gym does only with observability on), so its
calls are attributed the same way.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from nemo_gym_checkpoint_plugin._attach import (
    attach_checkpointing,
    install_client,
    refuse_unsupported,
    server_settings,
)
from nemo_gym_checkpoint_plugin._settings import SettingsError, load_settings

__all__ = ["CheckpointMixin", "check_storage_backend", "exit_on_bad_settings"]

# Where Gym tells a server process its config name (what nemo_gym.server_utils reads too).
_GYM_SERVER_NAME_ENV = "NEMO_GYM_CONFIG_PATH"


def exit_on_bad_settings(global_config: Any = None, server_config: Any = None) -> None:
    """Validate the ``checkpoint:`` block (its token, its storage backend) now; on failure print why and exit 2.

    With ``server_config`` (the server's own validated config) a combination checkpointing
    does not support yet (``refuse_unsupported``) exits the same way. The message names the
    server: its config name (``server_config.name``, else Gym's ``NEMO_GYM_CONFIG_PATH``).
    """
    try:
        settings, _ = load_settings(global_config)
        if server_config is not None:
            refuse_unsupported(server_config, settings, global_config)
        if settings.enabled:
            check_storage_backend(settings)
    except SettingsError as exc:
        server = getattr(server_config, "name", None) or os.environ.get(_GYM_SERVER_NAME_ENV)
        print(f"nemo-gym-checkpoint: refusing to start: {exc.for_server(server)}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def check_storage_backend(settings: Any) -> None:
    """``UnknownStorageBackend`` (a ``SettingsError``) when no plugin answers ``checkpoint.storage.backend``."""
    from nemo_gym_checkpoint_plugin._plugins import get_storage_backend, make_plugin_manager

    # The manager the server builds later is the same one (built-ins + the entry-point group).
    get_storage_backend(make_plugin_manager(), settings.storage.backend)


class CheckpointMixin:
    """Mixin for a Gym ``SimpleServer`` subclass (list it before the Gym base class)."""

    # Gym starts Ray for a class that leaves this unset; a checkpointed server never does.
    ray_enabled = False

    @classmethod
    def run_webserver(cls) -> Any:
        # Before Gym builds anything (and before any Ray or uvicorn start): a bad block never serves.
        exit_on_bad_settings(server_config=cls.load_config_from_global_config())  # type: ignore[attr-defined]
        if load_settings()[0].enabled:
            from nemo_gym_checkpoint_plugin._telemetry.spans import register_span_group

            # Before Gym's init_telemetry resolves its span_groups spec, which must find "checkpoint".
            register_span_group()
        return super().run_webserver()  # type: ignore[misc]

    def setup_webserver(self) -> Any:
        settings, token = server_settings(self)
        # Before the client swap: a refused server is left exactly as it was built.
        refuse_unsupported(self.config, settings, self.server_client.global_config_dict)  # type: ignore[attr-defined]
        if settings.enabled:
            install_client(self)
        app = super().setup_webserver()  # type: ignore[misc]
        attach_checkpointing(self, app, settings=settings, token=token)
        return app

    def rollout_id_from_run(self, body: Any) -> str | None:
        """An agent's capture key for a ``/run`` body: Gym's answer, else (checkpointing on) the body's own."""
        gym_answer = getattr(super(), "rollout_id_from_run", None)
        if gym_answer is None:
            return None  # not an agent
        rollout_id = gym_answer(body)
        if rollout_id is not None:
            return rollout_id
        from nemo_gym.rollout_correlation import maybe_rollout_id_from_run_body

        from nemo_gym_checkpoint_plugin._client import CheckpointServerClient

        # The plugin's client is installed exactly when checkpointing is on.
        if not isinstance(getattr(self, "server_client", None), CheckpointServerClient):
            return None
        return maybe_rollout_id_from_run_body(body)
