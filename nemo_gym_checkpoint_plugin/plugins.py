"""The plugin manager factory. Nothing happens at import time: call ``make_plugin_manager()``.

The manager lives on the app (the control plane), never in a module global.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Iterable
from typing import Any

import pluggy

from .markers import PROJECT

__all__ = ["ENTRY_POINT_GROUP", "PluginLoadError", "builtin_plugins", "make_plugin_manager", "get_storage_backend"]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = PROJECT


class PluginLoadError(RuntimeError):
    """A plugin of the ``nemo_gym_checkpoint`` entry-point group failed to load: the server must not start."""

    def __init__(self, name: str, cause: BaseException) -> None:
        super().__init__(f"checkpoint plugin {name!r} failed to load: {type(cause).__name__}: {cause}")
        self.plugin_name = name


def builtin_plugins() -> tuple[Any, ...]:
    """The explicit tuple of built-in plugins (core defaults, each ``trylast``).

    The local storage backend, the lease policy (``deadline_ts + lease_grace_seconds``,
    retry every 30 s) and PROTOCOL.md's coordination orders.
    """
    from .control.lease import DefaultLeasePolicy
    from .coordination.order import DefaultCoordinationOrder
    from .storage.local import LocalStoragePlugin

    return (LocalStoragePlugin(), DefaultLeasePolicy(), DefaultCoordinationOrder())


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    # Load each one ourselves so a failure names the plugin instead of surfacing as a bare traceback.
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if pm.get_plugin(entry_point.name) is not None or pm.is_blocked(entry_point.name):
            continue
        try:
            plugin = entry_point.load()
        except Exception as exc:
            raise PluginLoadError(entry_point.name, exc) from exc
        pm.register(plugin, name=entry_point.name)


def make_plugin_manager(extra_plugins: Iterable[Any] = (), *, load_entry_points: bool = True) -> pluggy.PluginManager:
    """Build a manager: add the specs, register built-ins, load the entry-point group, check.

    Every spec module of ``hookspecs.SPEC_MODULES`` (core and participant hooks) is added
    before any plugin registers, so a plugin's misspelt hook fails ``check_pending()``.
    ``extra_plugins`` are registered after the built-ins (tests and embedding code use it).
    Raises ``PluginLoadError`` naming a plugin that fails to import, and
    ``pluggy.PluginValidationError`` for an implementation that matches no spec.
    """
    from nemo_gym_checkpoint_plugin.hookspecs import SPEC_MODULES

    pm = pluggy.PluginManager(PROJECT)
    for module in SPEC_MODULES:
        pm.add_hookspecs(module)
    for plugin in builtin_plugins():
        pm.register(plugin)
    if load_entry_points:
        _load_entry_points(pm)
    for plugin in extra_plugins:
        pm.register(plugin)
    pm.check_pending()
    return pm


def get_storage_backend(pm: pluggy.PluginManager, name: Any) -> Any:
    """The backend registered under ``name``: a backend name, or the ``checkpoint.storage`` settings
    (``StorageSettings``), which are then handed to a backend offering ``configured(settings)``."""
    settings = None if isinstance(name, str) else name
    if settings is not None:
        name = settings.backend
    backend = pm.hook.storage_backend(name=name)
    if backend is None:
        raise LookupError(f"no storage backend named {name!r} (checkpoint.storage.backend); is its plugin installed?")
    configured = getattr(backend, "configured", None)
    if settings is not None and callable(configured):
        backend = configured(settings)
    return backend
