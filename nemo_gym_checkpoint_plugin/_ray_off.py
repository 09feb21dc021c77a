"""Entrypoint that runs an unmodified Gym server with Ray off: ``python -m nemo_gym_checkpoint_plugin._ray_off``.

Gym's ``SimpleServer.run_webserver()`` starts a Ray cluster unless the server class
declares ``ray_enabled = False``, and there is no config key to turn that off. Some of
the wheel's servers (``environment_servers/single_agent_turn`` in nemo-gym 0.7.0) leave
it unset. Started the way Gym starts servers (cwd = the server directory,
``NEMO_GYM_CONFIG_DICT`` / ``NEMO_GYM_CONFIG_PATH`` in the environment), this module
imports that directory's ``app`` module, finds its server class, declares Ray off and
runs it, exactly as ``python app.py`` would otherwise.

It installs no checkpointing at all: ``nemo_gym_checkpoint_plugin.wrap`` does the same
(Ray off) and also makes the server a participant when the ``checkpoint:`` block is on.
It refuses (exit status 2) a class that explicitly sets ``ray_enabled = True``: such a
server needs Ray, and running it without would fail later and less clearly.
"""

from __future__ import annotations

import importlib
import os
import sys

# The class lookup is the wrapper's; re-exported for callers that import it from here.
from nemo_gym_checkpoint_plugin.wrap import find_server_class

__all__ = ["find_server_class", "main"]


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
