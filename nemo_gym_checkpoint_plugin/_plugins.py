"""The plugin manager factory. Nothing happens at import time: call ``make_plugin_manager()``.

The manager lives on the app (the control plane), never in a module global.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import inspect
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import pluggy

from ._markers import PROJECT
from ._settings import SettingsError

__all__ = [
    "ENTRY_POINT_GROUP",
    "CheckpointPluginManager",
    "PluginLoadError",
    "UnknownStorageBackend",
    "attach_plugins",
    "builtin_plugins",
    "get_storage_backend",
    "make_plugin_manager",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = PROJECT


class PluginLoadError(RuntimeError):
    """A plugin of the ``nemo_gym_checkpoint`` entry-point group failed to load: the server must not start."""

    def __init__(self, name: str, cause: BaseException) -> None:
        super().__init__(f"checkpoint plugin {name!r} failed to load: {type(cause).__name__}: {cause}")
        self.cause = cause
        self.plugin_name = name


class UnknownStorageBackend(SettingsError, LookupError):
    """No plugin answers ``storage_backend`` for the configured name: a configuration error (exit status 2)."""


class CheckpointPluginManager(pluggy.PluginManager):
    """pluggy's manager, knowing which plugins are third parties (their records are tagged with their name).

    Third parties are the entry-point group's plugins and those registered through
    ``make_plugin_manager(named_plugins=...)``; everything else is the participant's own.
    """

    def __init__(self) -> None:
        super().__init__(PROJECT)
        self.third_party_names: set[str] = set()

    def register_third_party(self, plugin: Any, name: str) -> None:
        if not name or not isinstance(name, str):
            raise ValueError(f"a third-party plugin needs a non-empty name, got {name!r}")
        self.register(plugin, name=name)
        self.third_party_names.add(name)

    def unregister(self, plugin: Any = None, name: str | None = None) -> Any:
        if name is None and plugin is not None:
            name = self.get_name(plugin)
        removed = super().unregister(plugin, name)
        if name is not None:
            self.third_party_names.discard(name)
        return removed


def builtin_plugins() -> tuple[Any, ...]:
    """The explicit tuple of a server's built-in core plugins (each ``trylast``).

    The local storage backend and the lease policy (``deadline_ts + lease_grace_seconds``,
    retry every 30 s). The controller side has its own (``coordination._order.order_manager``):
    a server never loads the coordination package.
    """
    from ._control.lease import DefaultLeasePolicy
    from ._storage.local import LocalStoragePlugin

    return (LocalStoragePlugin(), DefaultLeasePolicy())


def _load_entry_points(pm: CheckpointPluginManager) -> None:
    # Load each one ourselves so a failure names the plugin instead of surfacing as a bare traceback.
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if pm.get_plugin(entry_point.name) is not None or pm.is_blocked(entry_point.name):
            continue
        try:
            plugin = entry_point.load()
        except Exception as exc:
            raise PluginLoadError(entry_point.name, exc) from exc
        pm.register_third_party(plugin, entry_point.name)


def make_plugin_manager(
    extra_plugins: Iterable[Any] = (),
    *,
    load_entry_points: bool = True,
    named_plugins: Mapping[str, Any] | None = None,
    builtins: Iterable[Any] | None = None,
) -> CheckpointPluginManager:
    """Build a manager: add the specs, register built-ins, load the entry-point group, check.

    Every spec module of ``hookspecs.SPEC_MODULES`` (core and participant hooks) is added
    before any plugin registers, so a plugin's misspelt hook fails ``check_pending()``.
    ``extra_plugins`` are registered after the built-ins as part of the participant itself
    (the built-in participants, tests and embedding code). ``named_plugins`` are registered
    as third parties under their names, as entry-point plugins are: their records carry that
    name (``"plugin"``) and come back to them alone on restore.
    Raises ``PluginLoadError`` naming a plugin that fails to import, and
    ``pluggy.PluginValidationError`` for an implementation that matches no spec.
    """
    from nemo_gym_checkpoint_plugin.hookspecs import SPEC_MODULES

    pm = CheckpointPluginManager()
    for module in SPEC_MODULES:
        pm.add_hookspecs(module)
    for plugin in builtin_plugins() if builtins is None else builtins:
        pm.register(plugin)
    if load_entry_points:
        _load_entry_points(pm)
    for plugin in extra_plugins:
        pm.register(plugin)
    for name, plugin in (named_plugins or {}).items():
        pm.register_third_party(plugin, name)
    pm.check_pending()
    return pm


def attach_plugins(pm: pluggy.PluginManager, **context: Any) -> list[str]:
    """Call every plugin's ``attach`` hook once; unregister those answering ``False``. Returns their names.

    ``context`` is the hook's keyword arguments (server, app, kind, instance, settings). A
    plugin that raises stops the caller (the server must not start), named in the error
    (``PluginLoadError``); a ``SettingsError`` (a configuration error) passes unchanged.
    """
    dropped: list[str] = []
    # Each implementation on its own, so a False names its plugin (as pluggy calls it: by argument name).
    for impl in list(pm.hook.attach.get_hookimpls()):
        try:
            answer = impl.function(*[context[arg] for arg in impl.argnames])
        except SettingsError:
            raise  # a configuration error (a built-in's bad checkpoint_mode): exit status 2, as it says
        except Exception as exc:
            raise PluginLoadError(impl.plugin_name, exc) from exc
        if inspect.isawaitable(answer):
            if inspect.iscoroutine(answer):
                answer.close()
            raise PluginLoadError(impl.plugin_name, TypeError("the attach hook must not be async"))
        if answer is False:
            pm.unregister(impl.plugin)
            dropped.append(impl.plugin_name)
    return dropped


def get_storage_backend(pm: pluggy.PluginManager, name: Any) -> Any:
    """The backend registered under ``name``: a backend name, or the ``checkpoint.storage`` settings
    (``StorageSettings``), which are then handed to a backend offering ``configured(settings)``."""
    settings = None if isinstance(name, str) else name
    if settings is not None:
        name = settings.backend
    backend = pm.hook.storage_backend(name=name)
    if backend is None:
        raise UnknownStorageBackend(_unknown_backend_message(pm, name))
    configured = getattr(backend, "configured", None)
    if settings is not None and callable(configured):
        backend = configured(settings)
    return backend


def storage_backend_names(pm: pluggy.PluginManager) -> tuple[list[str], list[str]]:
    """``(backend names declared, plugins answering storage_backend without declaring theirs)``.

    A plugin declares the names it answers as a ``storage_backend_names`` attribute (the built-in
    ``LocalStoragePlugin`` does); only then can an unknown name's message list them.
    """
    names: list[str] = []
    undeclared: list[str] = []
    for impl in pm.hook.storage_backend.get_hookimpls():
        declared = getattr(impl.plugin, "storage_backend_names", None)
        if declared is None:
            undeclared.append(impl.plugin_name)
            continue
        names.extend(str(n) for n in declared if str(n) not in names)
    return sorted(names), undeclared


def _unknown_backend_message(pm: pluggy.PluginManager, name: Any) -> str:
    names, undeclared = storage_backend_names(pm)
    close = difflib.get_close_matches(str(name), names, n=1, cutoff=0.6)
    message = f"checkpoint.storage.backend: no storage backend named {name!r}"
    if close:
        message += f" (did you mean {close[0]!r}?)"
    message += f"; the backends available: {', '.join(repr(n) for n in names) or 'none'}"
    if undeclared:
        message += f" (plus those of plugins that do not list theirs: {', '.join(undeclared)})"
    return message + "; is the backend's plugin installed?"
