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
message names both keys), when the class declares
``ray_enabled = True``, or when the server asks for ``num_workers > 1``: Gym then makes
each uvicorn worker import ``<server dir>/<entrypoint>`` as a module of the server's
package, which a wrapper outside that package cannot be (use ``CheckpointMixin`` in the
server's own ``app.py`` for multi-worker servers; they report ``unmanaged``).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["derive_checkpointable", "find_server_class", "main", "relative_entrypoint"]


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
    num_workers = server_config.num_workers
    if num_workers and num_workers > 1:
        _refuse(
            f"num_workers={num_workers}: Gym's workers import the server's own entrypoint module, so the wrapper "
            "cannot run them; set num_workers: 1, or add CheckpointMixin to the server class in its app.py"
        )
    derived.run_webserver()


if __name__ == "__main__":
    main()
