"""How a resources server (a verifier) checkpoints: its declared ``checkpoint_mode``.

docs/protocol.md "Restarts". Three modes:

- ``stateless``: the server keeps nothing per session; its episodes are capturable and
  ``/verify`` is replayable (every seed reply carries ``x-ng-checkpoint-verify: replay``);
- ``export_restore``: its per-session state is exported and installed by a plugin; its
  episodes are capturable (whether ``/verify`` replays is that plugin's ``seed_session``
  declaration);
- ``restart_only``: every episode it seeds is a restart.

Where the mode comes from, first found wins:

1. ``checkpoint_mode:`` in the server's own config block (next to ``entrypoint:``). Gym's
   server config classes ignore keys they do not declare (pydantic's default), so the key
   is read from the global config dict by the server's instance name, the same dict Gym
   built the config object from; a config class that declares or allows the key is read
   directly.
2. ``BUILTIN_MODES``: the wheel's verifiers this plugin has read and found stateless.
3. None (undeclared): the participant keeps its older rule (capturable only when
   ``seed_session`` is Gym's default, ``/verify`` never declared replayable).

A bad value stops the server at startup (``SettingsError`` naming the key and the server).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from nemo_gym_checkpoint_plugin._settings import SettingsError

__all__ = ["BUILTIN_MODES", "CHECKPOINT_MODE_KEY", "CheckpointMode", "declared_mode"]

CHECKPOINT_MODE_KEY = "checkpoint_mode"


class CheckpointMode(enum.StrEnum):
    STATELESS = "stateless"
    EXPORT_RESTORE = "export_restore"
    RESTART_ONLY = "restart_only"


# The wheel's (nemo-gym 0.7.0) verifiers whose /verify computes the reward from the request
# alone: no seed_session of their own, no attribute written per session, no randomness, no
# network (no judge model, no sandbox). Keyed by module and qualified name, so a subclass
# (which may add state) is not covered. Each is replayed by tests/test_verifier_declarations.py;
# docs/protocol.md "Restarts" lists them with the reason.
BUILTIN_MODES: dict[str, CheckpointMode] = {
    "resources_servers.arc_agi.app.ARCAGIResourcesServer": CheckpointMode.STATELESS,
    "resources_servers.circle_click.app.CircleClickResourcesServer": CheckpointMode.STATELESS,
    "resources_servers.circle_count.app.CircleCountResourcesServer": CheckpointMode.STATELESS,
    "resources_servers.ruler.app.RulerResourcesServer": CheckpointMode.STATELESS,
    "resources_servers.xlam_fc.app.XlamFcResourcesServer": CheckpointMode.STATELESS,
}


def _configured(server: Any) -> tuple[Any, str]:
    """The raw ``checkpoint_mode`` value of the server's config block (None: absent) and the server's name."""
    config = getattr(server, "config", None)
    name = str(getattr(config, "name", None) or type(server).__name__)
    value = getattr(config, CHECKPOINT_MODE_KEY, None)
    if value is not None:
        return value, name
    global_config = getattr(getattr(server, "server_client", None), "global_config_dict", None)
    block = _server_block(global_config, name)
    return (block.get(CHECKPOINT_MODE_KEY) if block is not None else None), name


def _server_block(global_config: Any, name: str) -> Mapping[str, Any] | None:
    # Gym's layout: {instance name: {"resources_servers": {implementation: {entrypoint, ...}}}}.
    if not isinstance(global_config, Mapping) and not hasattr(global_config, "get"):
        return None
    instance = global_config.get(name)
    if not hasattr(instance, "values"):
        return None
    kinds = list(instance.values())
    if len(kinds) != 1 or not hasattr(kinds[0], "values"):
        return None
    blocks = list(kinds[0].values())
    if len(blocks) != 1 or not hasattr(blocks[0], "get"):
        return None
    return blocks[0]


def declared_mode(server: Any) -> CheckpointMode | None:
    """The checkpoint mode ``server`` declares (config key, then the built-in table); None: undeclared."""
    value, name = _configured(server)
    if value is not None:
        try:
            return CheckpointMode(value)
        except ValueError:
            allowed = ", ".join(mode.value for mode in CheckpointMode)
            raise SettingsError(
                f"server {name!r}: {CHECKPOINT_MODE_KEY}: {value!r} is not one of {allowed}"
            ) from None
    cls = type(server)
    return BUILTIN_MODES.get(f"{cls.__module__}.{cls.__qualname__}")
