"""Entrypoint that runs an unmodified Gym server with Ray off: ``python -m nemo_gym_checkpoint_plugin.ray_off``.

Gym's ``SimpleServer.run_webserver()`` starts a Ray cluster unless the server class
declares ``ray_enabled = False``, and there is no config key to turn that off. Some of
the wheel's servers (``environment_servers/single_agent_turn`` in nemo-gym 0.7.0) leave
it unset. Started the way Gym starts servers (cwd = the server directory,
``NEMO_GYM_CONFIG_DICT`` / ``NEMO_GYM_CONFIG_PATH`` in the environment), this module
imports that directory's ``app`` module, finds its server class, declares Ray off and
runs it, exactly as ``python app.py`` would otherwise.

It refuses (exit status 2) a class that explicitly sets ``ray_enabled = True``: such a
server needs Ray, and running it without would fail later and less clearly.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from types import ModuleType

__all__ = ["find_server_class", "main"]


def find_server_class(module: ModuleType) -> type:
    """The most derived ``SimpleServer`` subclass defined in ``module``; ``LookupError`` if not exactly one."""
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


def main(module_name: str = "app") -> None:
    # `python -m` puts the cwd first on sys.path, as `python app.py` puts the server dir; keep that true
    # even when launched another way, so the server's own sibling imports resolve.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    server_class = find_server_class(importlib.import_module(module_name))
    if server_class.ray_enabled:
        print(f"{server_class.__name__} declares ray_enabled = True: it cannot run with Ray off", file=sys.stderr)
        raise SystemExit(2)
    # Set on the class itself (no subclass): Gym derives the session cookie secret from the class name.
    server_class.ray_enabled = False
    server_class.run_webserver()


if __name__ == "__main__":
    main()
