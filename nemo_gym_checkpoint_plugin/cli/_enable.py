"""``ng-checkpoint enable GYM_YAML [-o OUT]``: from a Gym config to a checkpointed deployment ``ng_run`` starts.

Two things, both needed for Gym's own launcher (``ng_run`` / ``gym env start``, ``RunHelper``):

1. **The config.** Gym's launcher runs ``<server venv>/bin/python <entrypoint>`` from the
   server directory, with the entrypoint a relative path. ``LAUNCH_ENTRYPOINT``
   (``-mnemo_gym_checkpoint_plugin.wrap``) is one: Python reads it as its own ``-m`` option
   (CPython accepts the module glued to ``-m``, as in ``python -mpip``), the launcher passes it
   through unquoted (only shell-safe characters), and it names no path, so the same config
   works wherever Gym and the plugin are installed. The config written has every server's
   ``entrypoint:`` set to it, the server's host and port pinned (so ``ng-checkpoint --config``
   finds every server without Gym's parser), a ``checkpoint:`` block (the one given, with
   ``enabled: true``; else one naming the token's variable) and ``skip_venv_if_present: true``.
2. **The environments.** Gym's launcher runs each server in its own venv
   (``uv_venv_dir/<type>/<name>/.venv``, ``uv_venv_dir`` defaulting to the working directory
   for a wheel install) and, with ``skip_venv_if_present``, reuses one that exists instead of
   building it with ``uv`` (whose install never includes this plugin: Gym computes its
   ``head_server_deps`` itself). For each server, ``enable`` makes sure that venv imports the
   plugin: a venv that already does is left alone; one that does not exist is created (the
   standard library's ``venv``, this interpreter); and a venv that cannot import it gets a
   ``.pth`` file layering this environment's site-packages under its own (``site.addsitedir``,
   so this environment's editable installs and ``.pth`` files apply too; the venv's own
   packages still win). No symlinked venvs, nothing written into Gym's install.

Run it from the directory ``ng_run`` will run from when the config leaves ``uv_venv_dir`` unset.
"""

from __future__ import annotations

import argparse
import os
import site
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .._wire import SERVER_TYPES
from ._where import UsageError

__all__ = ["LAUNCH_ENTRYPOINT", "PTH_NAME", "ServerEnvironment", "checkpointed_config", "run_enable"]

LAUNCH_ENTRYPOINT = "-mnemo_gym_checkpoint_plugin.wrap"
PTH_NAME = "_nemo_gym_checkpoint_layer.pth"
_PROBE = "import nemo_gym, nemo_gym_checkpoint_plugin.wrap"


@dataclass(frozen=True)
class ServerEnvironment:
    """One server of the config: where Gym's launcher runs it, and what ``enable`` did to its venv."""

    name: str
    server_type: str
    implementation: str
    server_dir: Path
    venv: Path
    action: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.server_type,
            "implementation": self.implementation,
            "server_dir": str(self.server_dir),
            "venv": str(self.venv),
            "action": self.action,
        }


def _parse(path: Path) -> Any:
    """The config as Gym's launcher will see it (``config_paths`` merged, defaults filled), without side effects."""
    from nemo_gym.global_config import GlobalConfigDictParser, GlobalConfigDictParserConfig
    from omegaconf import OmegaConf

    return GlobalConfigDictParser().parse(
        GlobalConfigDictParserConfig(
            initial_global_config_dict=OmegaConf.create({"config_paths": [str(path)]}),
            skip_load_from_cli=True,
            skip_load_from_dotenv=True,
            offline=True,
        )
    )


def _servers(parsed: Any) -> list[tuple[str, str, str, Any]]:
    """(top-level name, server type, implementation, inner block) of every server with an entrypoint."""
    found = []
    for name, block in parsed.items():
        if not hasattr(block, "keys") or len(block) != 1:
            continue
        (server_type,) = block.keys()
        inner_map = block[server_type]
        if server_type not in SERVER_TYPES or not hasattr(inner_map, "keys") or len(inner_map) != 1:
            continue
        (implementation,) = inner_map.keys()
        inner = inner_map[implementation]
        if hasattr(inner, "keys") and "entrypoint" in inner:
            found.append((str(name), str(server_type), str(implementation), inner))
    return found


def _environments(parsed: Any) -> list[ServerEnvironment]:
    # Gym's own lookups, so the venv is the one its launcher will use: the server dir (extra roots,
    # cwd, then the install, with its marker files) and get_venv_path (uv_venv_dir or <dir>/.venv).
    from nemo_gym import _resolve_under_cwd_or_install
    from nemo_gym.cli.setup_command import get_venv_path

    environments = []
    for name, server_type, implementation, _inner in _servers(parsed):
        server_dir = _resolve_under_cwd_or_install(
            Path(server_type, implementation),
            validator=lambda d: (d / "requirements.txt").exists() or (d / "pyproject.toml").exists(),
        ).resolve()
        environments.append(
            ServerEnvironment(name, server_type, implementation, server_dir, get_venv_path(server_dir, parsed))
        )
    return environments


def _port_range(parsed: Any) -> tuple[int, int]:
    from nemo_gym.global_config import PORT_RANGE_HIGH_KEY_NAME, PORT_RANGE_LOW_KEY_NAME

    return int(parsed.get(PORT_RANGE_LOW_KEY_NAME) or 10001), int(parsed.get(PORT_RANGE_HIGH_KEY_NAME) or 20000)


def _free_port(taken: set[int], low: int, high: int) -> int:
    """A port in Gym's range that no server of the config uses and that binds on 127.0.0.1 now."""
    import random
    import socket

    candidates = [port for port in range(low, high + 1) if port not in taken]
    random.shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise UsageError(f"no free port found in Gym's range {low}-{high} for a server without one; give it a port")


def checkpointed_config(
    original: dict[str, Any], parsed: Any, token_env: str, chosen: dict[str, int] | None = None
) -> dict[str, Any]:
    """``original`` with every server wrapped, addressed, the ``checkpoint:`` block on, and venvs reused.

    A server whose config gives no port (Gym's offline parse says -1: its launcher would pick one at
    start, which ``ng-checkpoint --config`` could not find) gets a free port of Gym's range, pinned
    here; ``chosen`` (when given) receives ``{server: port}`` for those.
    """
    out = dict(original)
    servers = _servers(parsed)
    taken = {int(inner.get("port")) for *_rest, inner in servers if isinstance(inner.get("port"), int)}
    low, high = _port_range(parsed)
    for name, server_type, implementation, inner in servers:
        block = dict(out.get(name) or {})
        types = dict(block.get(server_type) or {})
        server = dict(types.get(implementation) or {})
        server["entrypoint"] = LAUNCH_ENTRYPOINT
        for key in ("host", "port"):
            if inner.get(key) is not None and key not in server:
                server[key] = inner.get(key)
        port = server.get("port")
        if not isinstance(port, int) or isinstance(port, bool) or port <= 0:
            server["port"] = _free_port(taken, low, high)
            taken.add(server["port"])
            if chosen is not None:
                chosen[name] = server["port"]
        types[implementation] = server
        block[server_type] = types
        out[name] = block
    checkpoint = dict(out.get("checkpoint") or {})
    checkpoint["enabled"] = True
    if not checkpoint.get("control_auth_token_env") and not checkpoint.get("control_auth_token"):
        checkpoint["control_auth_token_env"] = token_env
    out["checkpoint"] = checkpoint
    out["skip_venv_if_present"] = True
    return out


_BACKEND_PROBE = (
    "import sys\n"
    "from nemo_gym_checkpoint_plugin._settings import SettingsError, StorageSettings\n"
    "from nemo_gym_checkpoint_plugin.mixin import check_storage_backend\n"
    "class _Settings:\n"
    "    storage = StorageSettings(backend=sys.argv[1])\n"
    "try:\n"
    "    check_storage_backend(_Settings)\n"
    "except SettingsError as exc:\n"
    "    print(exc, file=sys.stderr); sys.exit(2)\n"
)


def _check_block(config: dict[str, Any]) -> None:
    """The ``checkpoint:`` block as the servers will validate it (keys, values, storage backend): UsageError if not.

    The storage backend is looked up by a server's own check in a child interpreter: this program
    never loads the server runtime.
    """
    from nemo_gym_checkpoint_plugin._settings import SettingsError, settings_from_global_config

    try:
        settings = settings_from_global_config(config)
    except SettingsError as exc:
        raise UsageError(f"the checkpoint: block would stop every server: {exc}; nothing was written") from None
    backend = settings.storage.backend
    if backend == type(settings.storage)().backend:
        return  # the built-in default
    done = subprocess.run([sys.executable, "-c", _BACKEND_PROBE, backend], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise UsageError(f"the checkpoint: block would stop every server: {why}; nothing was written")


def _site_dirs() -> list[str]:
    """This environment's site-packages directories, the ones a layered venv adds under its own."""
    dirs = [*site.getsitepackages()]
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


def _imports_plugin(python: Path, cwd: Path) -> bool:
    # PYTHONPATH as the launcher sets it (the server dir), nothing of this process's.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(cwd)
    done = subprocess.run([str(python), "-c", _PROBE], cwd=cwd, env=env, capture_output=True, timeout=120)
    return done.returncode == 0


def _venv_site_packages(venv_dir: Path) -> Path:
    python = venv_dir / "bin" / "python"
    done = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return Path(done.stdout.strip())


def prepare_environment(server: ServerEnvironment) -> ServerEnvironment:
    """Make the server's venv import the plugin; returns the server with what was done (``action``)."""
    python = server.venv / "bin" / "python"
    created = False
    if not (python.exists() and (server.venv / "bin" / "activate").exists()):
        # This interpreter (Gym pins its servers' Python to the launcher's), no pip: nothing is installed in it.
        venv.EnvBuilder(with_pip=False, symlinks=True, clear=False).create(server.venv)
        created = True
    elif _imports_plugin(python, server.server_dir):
        return ServerEnvironment(**{**server.__dict__, "action": "kept (imports the plugin)"})
    lines = [f"import site; site.addsitedir({d!r})" for d in _site_dirs()]
    layer = _venv_site_packages(server.venv) / PTH_NAME
    layer.write_text(
        "# nemo-gym-checkpoint: this environment's packages, under the venv's own\n" + "\n".join(lines) + "\n",
        encoding="utf-8",
    )
    if not _imports_plugin(python, server.server_dir):
        raise UsageError(
            f"{server.name}: {server.venv} still cannot import nemo_gym and the plugin after adding "
            f"{layer}; is ng-checkpoint running from the environment nemo-gym is installed in?"
        )
    action = "created, layered on this environment" if created else "layered on this environment"
    return ServerEnvironment(**{**server.__dict__, "action": action})


def _write(path: Path, text: str, *, private: bool) -> None:
    """Write the config; mode 0600 (whatever the umask) when it holds a token."""
    if not private:
        path.write_text(text, encoding="utf-8")
        return
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # an existing file keeps its mode on open: set it
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)


def _default_out(path: Path) -> Path:
    return path.with_name(f"{path.stem}.checkpointed{path.suffix or '.yaml'}")


def run_enable(args: argparse.Namespace) -> dict[str, Any]:
    """Write the checkpointed config (unless the input already is one) and prepare every server's venv."""
    source = Path(args.config)
    if not source.is_file():
        raise UsageError(f"{args.config} does not exist" if not source.exists() else f"{args.config} is not a file")
    try:
        original = yaml.safe_load(source.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UsageError(f"{args.config} is not a readable YAML file: {str(exc).splitlines()[0]}") from None
    if not isinstance(original, dict):
        raise UsageError(f"{args.config} is not a Gym config (a mapping at the top)")
    try:
        parsed = _parse(source.resolve())
    except Exception as exc:  # Gym's parser raises many kinds; its message (which keys, where) is what helps
        lines = [line for line in str(exc).splitlines() if line.strip()][:12] or [repr(exc)]
        raise UsageError(f"Gym cannot parse {args.config}: " + "\n".join(lines)) from None
    servers = _environments(parsed)
    if not servers:
        raise UsageError(f"{args.config} defines no server (no block with an entrypoint)")
    chosen: dict[str, int] = {}
    wanted = checkpointed_config(original, parsed, args.token_env, chosen)
    _check_block(wanted)
    inline_token = bool(wanted["checkpoint"].get("control_auth_token"))
    config = source
    written = None
    if wanted != original or args.output:
        config = Path(args.output) if args.output else _default_out(source)
        if config.resolve() == source.resolve() and not args.output:
            raise UsageError(f"refusing to overwrite {args.config}; pass -o OUT")
        _write(config, yaml.safe_dump(wanted, sort_keys=False), private=inline_token)
        written = str(config)
    prepared = [prepare_environment(server) for server in servers]
    token_env = wanted["checkpoint"].get("control_auth_token_env")
    warnings = [
        f"{name}: no port in the config, pinned to {port} (free now; ng_run needs it free at start)"
        for name, port in sorted(chosen.items())
    ]
    if inline_token:
        warnings.append(
            f"{config} holds checkpoint.control_auth_token: written mode 0600; Gym's head server "
            "serves the whole config unauthenticated, so prefer checkpoint.control_auth_token_env"
        )
    return {
        "config": str(config),
        "written": written,
        "token_env": token_env,
        "ports_chosen": chosen,
        "warnings": warnings,
        "servers": [s.to_json() for s in prepared],
        "ng_run": f"ng_run '+config_paths=[{config.resolve()}]'",
        "cwd": os.getcwd(),
        "python": sys.executable,
    }
