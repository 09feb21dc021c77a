"""Wrapper entrypoint: run an unmodified Gym server (e.g. one shipped in the nemo-gym wheel) as a participant.

Point a server's ``entrypoint:`` at it instead of ``app.py``. Started the way Gym starts
servers (cwd = the server directory, ``NEMO_GYM_CONFIG_DICT`` / ``NEMO_GYM_CONFIG_PATH``
in the environment), it imports that directory's ``app`` module, finds its one
``SimpleServer`` class, derives ``CheckpointMixin`` + that class (same name, so Gym's
session cookie is unchanged) and runs it. Two ways to name it:

- by path, which is what Gym's own ``RunHelper`` needs (it runs ``python <entrypoint>``
  with a path relative to the server directory): ``relative_entrypoint(server_dir)``
  gives that path to this file;
- as a module, ``python -m nemo_gym_checkpoint_plugin.wrap`` (launchers that accept it,
  such as this project's ``Deployment``).

It also does what ``ray_off`` did: Ray stays off. It exits with status 2 and a message on
stderr when the ``checkpoint:`` block is bad (naming the key), when the server sets
``expose_tools_over_mcp: true`` with checkpointing enabled (not supported yet; the
message names both keys), when an agent asks for ``num_workers > 1`` with checkpointing
enabled, or when the class declares ``ray_enabled = True``.

Several workers (``num_workers > 1``, docs/protocol.md section 9a): Gym makes each uvicorn
worker import ``<type>.<server>.<entrypoint>`` (the entrypoint's path with ``/`` as dots, e.g.
``resources_servers.example.-mnemo_gym_checkpoint_plugin.wrap``), a name no file answers.
uvicorn spawns its workers, and a spawned process first runs the parent's main module again
as ``__mp_main__``: this module then registers itself under that name (``sys.modules``, from
Gym's ``IS_NEMO_GYM_FASTAPI_ENTRYPOINT``), so the import finds it, and its ``app`` is built on
first access the way ``main`` builds the server (``run_webserver`` returns the app in a worker).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "derive_checkpointable",
    "find_server_class",
    "gym_worker_module_name",
    "main",
    "register_worker_module",
    "relative_entrypoint",
    "worker_app",
]


def find_server_class(module: ModuleType) -> type[Any]:
    """The most derived ``SimpleServer`` subclass defined in ``module``; ``LookupError`` if not exactly one.

    ``type[Any]``: a Gym server class, whose attributes (``ray_enabled``, ``run_webserver``) Gym declares
    without types (nemo-gym ships none)."""
    from nemo_gym.server_utils import SimpleServer

    defined = [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj)
        and issubclass(obj, SimpleServer)
        and obj is not SimpleServer
        and obj.__module__ == module.__name__
    ]
    leaves = [cls for cls in defined if not any(other is not cls and issubclass(other, cls) for other in defined)]
    if len(leaves) != 1:
        names = sorted(cls.__name__ for cls in leaves)
        raise LookupError(f"expected one SimpleServer subclass in {module.__name__}, found {names or 'none'}")
    return leaves[0]


def derive_checkpointable(server_class: type[Any]) -> type[Any]:
    """``CheckpointMixin`` (+ built-in step reporting, if any) + ``server_class``, under the same name.

    The name is kept because Gym's cookie secret is derived from it. For a class the built-in
    participants know (``single_agent_turn``) their run logic mixin is added; it is inert
    while checkpointing is disabled.
    """
    from nemo_gym_checkpoint_plugin.mixin import CheckpointMixin

    if issubclass(server_class, CheckpointMixin):
        return server_class
    from nemo_gym_checkpoint_plugin.builtin_participants import checkpointable_bases

    namespace = {"__module__": server_class.__module__, "__qualname__": server_class.__qualname__}
    # The class's own declaration wins over the mixin's default (False) only when it is explicit.
    if "ray_enabled" in vars(server_class):
        namespace["ray_enabled"] = vars(server_class)["ray_enabled"]
    # Run logic that reports episode steps (single_agent_turn) goes between the mixin and the class.
    return type(server_class.__name__, (CheckpointMixin, *checkpointable_bases(server_class), server_class), namespace)


def relative_entrypoint(server_dir: Path | str) -> str:
    """The ``entrypoint:`` value that runs this wrapper from ``server_dir`` (a relative path, as Gym requires)."""
    return os.path.relpath(Path(__file__).resolve(), Path(server_dir).resolve())


def _fix_sys_path() -> None:
    # Run by path, Python puts this package's directory first on sys.path, where its modules
    # (errors, settings, client...) would shadow top-level ones; the server dir belongs there instead.
    own_dir = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != Path(own_dir)]
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def _refuse(message: str) -> None:
    print(f"nemo-gym-checkpoint: refusing to start: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def main(module_name: str = "app") -> None:
    _fix_sys_path()
    from nemo_gym_checkpoint_plugin.mixin import exit_on_bad_settings

    exit_on_bad_settings()
    server_class = find_server_class(importlib.import_module(module_name))
    if server_class.ray_enabled:
        _refuse(f"{server_class.__name__} declares ray_enabled = True: it cannot run with Ray off")
    derived = derive_checkpointable(server_class)
    server_config = derived.load_config_from_global_config()
    exit_on_bad_settings(server_config=server_config)
    derived.run_webserver()


def gym_worker_module_name() -> str | None:
    """The module a uvicorn worker of this Gym server imports (None: this is no such worker)."""
    from nemo_gym.server_utils import IS_NEMO_GYM_FASTAPI_ENTRYPOINT_KEY_NAME, is_nemo_gym_fastapi_worker

    relative = os.environ.get(IS_NEMO_GYM_FASTAPI_ENTRYPOINT_KEY_NAME)
    if not is_nemo_gym_fastapi_worker() or not relative:
        return None
    # Exactly as Gym's run_webserver makes uvicorn's import string.
    return relative.replace(".py", "").replace("/", ".")


def worker_app(module_name: str = "app") -> Any:
    """A uvicorn worker's app: the wrapped server built as ``main`` builds it (Gym returns the app in a worker)."""
    _fix_sys_path()
    from nemo_gym_checkpoint_plugin.mixin import exit_on_bad_settings

    exit_on_bad_settings()
    derived = derive_checkpointable(find_server_class(importlib.import_module(module_name)))
    return derived.run_webserver()


def register_worker_module() -> None:
    """In a uvicorn worker: answer Gym's import of ``<type>.<server>.<entrypoint>`` with a module whose ``app``
    is ``worker_app()`` (built on first access, once)."""
    name = gym_worker_module_name()
    if name is None or name in sys.modules:
        return
    module = ModuleType(name, "The wrapped Gym server of this uvicorn worker (nemo_gym_checkpoint_plugin.wrap).")
    built: dict[str, Any] = {}

    def __getattr__(attribute: str) -> Any:
        if attribute != "app":
            raise AttributeError(f"module {name!r} has no attribute {attribute!r}")
        if "app" not in built:
            built["app"] = worker_app()
        return built["app"]

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[name] = module


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":
    # A process uvicorn spawned for this server runs the parent's main module again under this name first.
    register_worker_module()
