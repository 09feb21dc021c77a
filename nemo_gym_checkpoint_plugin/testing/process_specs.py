"""How each process of a ``Deployment`` starts: its argv, cwd, environment and readiness probe.

A Gym server starts as Gym's ``RunHelper`` starts it, minus the per-server venv: cwd = its
directory, ``python <entrypoint>`` with ``NEMO_GYM_CONFIG_DICT`` (the YAML) and
``NEMO_GYM_CONFIG_PATH`` (its top-level name) in the environment, the server directory on
``PYTHONPATH``. An entrypoint ending in ``.py`` is a path (relative to the server directory,
or absolute); anything else is a module run with ``python -m``. The fake inference backend
runs as ``python -m nemo_gym_checkpoint_plugin.testing.fake_backend`` from the installed
package. Starting, probing and stopping the processes is ``deployment.py``'s.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .gym_config import BACKEND, FAKE_MODEL_NAME, GYM_SERVERS, HOST, server_location

__all__ = ["FAKE_BACKEND_MODULE", "ProcessSpec", "backend_spec", "fake_backend_script", "gym_specs"]


# The fake backend is a module of this package, so an installed wheel runs it as well as a source checkout.
FAKE_BACKEND_MODULE = "nemo_gym_checkpoint_plugin.testing.fake_backend"


def fake_backend_script() -> Path:
    """The fake backend's module file, inside the installed package (``python <it> --port N`` runs it too)."""
    # Found, not imported: the path alone needs neither FastAPI nor uvicorn loaded here.
    spec = importlib.util.find_spec(FAKE_BACKEND_MODULE)
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).resolve()


@dataclass(frozen=True)
class ProcessSpec:
    """How to start one server process and how to tell it is ready."""

    name: str
    argv: tuple[str, ...]
    cwd: Path
    env: Mapping[str, str]
    url: str
    ready_path: str


def gym_specs(
    config: Any,
    config_yaml: str,
    server_dirs: Mapping[str, Path] | None = None,
    python: str = sys.executable,
    names: tuple[str, ...] = GYM_SERVERS,
) -> list[ProcessSpec]:
    """One spec per server of ``names`` in ``config`` (``config_yaml`` is its YAML).

    ``server_dirs`` (``{name: directory}``) override Gym's own lookup of a server's directory.
    """
    from nemo_gym import _resolve_under_cwd_or_install

    specs = []
    for name in names:
        server_type, implementation, inner = server_location(config, name)
        # Gym's own lookup for a server dir (extra roots, cwd, then the install), with its own marker files.
        server_dir = (server_dirs or {}).get(name) or _resolve_under_cwd_or_install(
            Path(server_type, implementation),
            validator=lambda d: (d / "requirements.txt").exists() or (d / "pyproject.toml").exists(),
        )
        entrypoint = str(inner["entrypoint"])
        # A path (``app.py``), the ``-m<module>`` form Gym's own launcher also runs, or a bare module name.
        if entrypoint.endswith(".py"):
            run: tuple[str, ...] = (entrypoint,)
        else:
            run = ("-m", entrypoint.removeprefix("-m"))
        specs.append(
            ProcessSpec(
                name=name,
                argv=(python, *run),
                cwd=server_dir,
                env={
                    "NEMO_GYM_CONFIG_DICT": config_yaml,
                    "NEMO_GYM_CONFIG_PATH": name,
                    # As Gym's run_command does: `import app` and sibling modules resolve from the server dir.
                    "PYTHONPATH": os.pathsep.join(p for p in (str(server_dir), os.environ.get("PYTHONPATH")) if p),
                },
                url=f"http://{inner['host']}:{inner['port']}",
                ready_path="/readyz",
            )
        )
    return specs


def backend_spec(port: int, work_dir: Path, python: str = sys.executable) -> ProcessSpec:
    """The fake inference backend on ``port``, run from ``work_dir``."""
    return ProcessSpec(
        name=BACKEND,
        # -m, cwd the work dir: this package's directory never lands first on the backend's sys.path.
        argv=(python, "-m", FAKE_BACKEND_MODULE, "--host", HOST, "--port", str(port), "--model", FAKE_MODEL_NAME),
        cwd=work_dir,
        env={},
        url=f"http://{HOST}:{port}",
        ready_path="/v1/models",
    )
