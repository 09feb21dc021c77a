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

Session state (``session_state.py``): ``checkpoint_session_state: [attr, ...]`` in the same block
names the server's per-session dict attributes (keyed by Gym's session id) that the built-in
resources participant exports and installs; ``BUILTIN_SESSION_STATE`` names them for the
wheel's servers this plugin has read. A server with session state is ``export_restore``
(declaring ``stateless`` or ``restart_only`` beside it is refused at startup, naming both keys).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from nemo_gym_checkpoint_plugin._settings import SettingsError

__all__ = [
    "BUILTIN_MODES",
    "BUILTIN_SESSION_STATE",
    "CHECKPOINT_MODE_KEY",
    "SESSION_STATE_KEY",
    "CheckpointMode",
    "declared",
    "declared_mode",
    "declared_session_state",
]

CHECKPOINT_MODE_KEY = "checkpoint_mode"
SESSION_STATE_KEY = "checkpoint_session_state"


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

# The wheel's (nemo-gym 0.7.0) servers whose whole per-session state is dicts keyed by Gym's
# session id, holding values session_state.encode takes: checkpointed with no config and no
# plugin (export_restore). Same keying as BUILTIN_MODES (a subclass is not covered).
# - example_session_state_mgmt: session_id_to_counter {session id: int}, set at seed, changed
#   by /increment_counter, read by /verify;
# - blackjack: GymnasiumServer.session_state {session id: {"player", "dealer": [card],
#   "rng": random.Random}}: the hands and the deck's random-number state, so a restored game
#   deals the same next cards.
BUILTIN_SESSION_STATE: dict[str, tuple[str, ...]] = {
    "resources_servers.example_session_state_mgmt.app.StatefulCounterResourcesServer": ("session_id_to_counter",),
    "resources_servers.blackjack.app.BlackjackEnv": ("session_state",),
}


def _class_key(server: Any) -> str:
    cls = type(server)
    return f"{cls.__module__}.{cls.__qualname__}"


def _configured(server: Any, key: str = CHECKPOINT_MODE_KEY) -> tuple[Any, str]:
    """The raw ``key`` value of the server's config block (None: absent) and the server's name."""
    config = getattr(server, "config", None)
    name = str(getattr(config, "name", None) or type(server).__name__)
    value = getattr(config, key, None)
    if value is not None:
        return value, name
    global_config = getattr(getattr(server, "server_client", None), "global_config_dict", None)
    block = _server_block(global_config, name)
    return (block.get(key) if block is not None else None), name


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
            raise SettingsError(f"server {name!r}: {CHECKPOINT_MODE_KEY}: {value!r} is not one of {allowed}") from None
    return BUILTIN_MODES.get(_class_key(server))


def declared_session_state(server: Any) -> tuple[tuple[str, ...], bool]:
    """The per-session dict attributes ``server`` names, and whether its config named them (else the table).

    ``((), False)`` for none. Raises ``SettingsError`` naming the key and the server for a value
    that is not a non-empty list of distinct attribute names, each a dict attribute of the server.
    """
    value, name = _configured(server, SESSION_STATE_KEY)
    if value is None:
        return BUILTIN_SESSION_STATE.get(_class_key(server), ()), False

    def refuse(why: str) -> SettingsError:
        return SettingsError(f"server {name!r}: {SESSION_STATE_KEY}: {why}")

    if isinstance(value, (str, bytes)) or isinstance(value, Mapping) or not hasattr(value, "__iter__"):
        raise refuse(f"{value!r} is not a list of attribute names")
    attrs = list(value)
    if not attrs:
        raise refuse("the list is empty (remove the key for a server without session state)")
    for attr in attrs:
        if not isinstance(attr, str) or not attr.isidentifier():
            raise refuse(f"{attr!r} is not an attribute name")
        if not isinstance(getattr(server, attr, None), dict):
            found = type(getattr(server, attr)).__name__ if hasattr(server, attr) else "no such attribute"
            raise refuse(f"{type(server).__name__}.{attr} is not a dict keyed by session id ({found})")
    if len(set(attrs)) != len(attrs):
        raise refuse(f"{attrs} names an attribute twice")
    return tuple(attrs), True


def declared(server: Any) -> tuple[CheckpointMode | None, tuple[str, ...]]:
    """``server``'s checkpoint mode and session-state attributes, reconciled.

    Session state makes the server ``export_restore``. A configured ``stateless`` or
    ``restart_only`` beside a configured ``checkpoint_session_state`` is refused
    (``SettingsError`` naming both keys); beside the built-in table's attributes the configured
    mode wins and nothing is exported.
    """
    mode = declared_mode(server)
    attrs, configured = declared_session_state(server)
    if not attrs or mode is None or mode is CheckpointMode.EXPORT_RESTORE:
        return (CheckpointMode.EXPORT_RESTORE if attrs else mode), attrs
    if not configured:
        return mode, ()
    name = str(getattr(getattr(server, "config", None), "name", None) or type(server).__name__)
    raise SettingsError(
        f"server {name!r}: {CHECKPOINT_MODE_KEY}: {mode.value!r} contradicts {SESSION_STATE_KEY} "
        f"{list(attrs)}: a server with session state is {CheckpointMode.EXPORT_RESTORE.value}"
    )
