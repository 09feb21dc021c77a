"""``make serve``: run the demo Gym deployment in the foreground until SIGTERM or Ctrl-C.

``python -m nemo_gym_checkpoint_plugin.testing.serve`` starts the fake inference backend and the
four Gym servers of ``deployment.py`` on 127.0.0.1, ports from ``PORT_BASE`` (default
18000, six consecutive ports). The control token comes from ``NG_CHECKPOINT_TOKEN``; when
unset, one is generated with ``secrets``, exported to every server and written to
``<work dir>/token`` (mode 0600) so a controller can read it. The work dir is
``NG_SERVE_DIR`` (default ``<tmp>/nemo-gym-checkpoint-serve-<PORT_BASE>``) and holds the
Gym YAML the servers run with (``gym_config.yaml``). ``NUM_WORKERS=N`` (``make serve NUM_WORKERS=N``)
runs the model, resources and environment servers with N uvicorn workers each (the agent stays
single-worker: Gym's rule for agent sessions); unset or 1, the deployment is exactly the single-worker one.

Once every server answers, stdout gets exactly one JSON line and nothing else::

    {"servers": {"<name>": "<url>", ...}, "token_env": "NG_CHECKPOINT_TOKEN", "config": "<yaml path>",
     "token_file": "<work dir>/token"}

``token_file`` is null when the token came from ``NG_CHECKPOINT_TOKEN`` (then nothing is written).

One ``make serve`` per ``PORT_BASE``: before writing anything, serve takes an exclusive lock on
``<work dir>/serve.lock`` and checks that its ports on 127.0.0.1 are free; when another serve
holds the lock or a port is taken it exits 2 with one line saying so, and the running
deployment's token and config files stay as they were.

Everything else (the servers' logs included) goes to stderr.

Stopping: a SIGTERM or SIGINT to this process alone is enough (GNU make forwards a SIGTERM
sent to ``make serve`` to its recipe, i.e. here). Ctrl-C or a SIGTERM to the whole process group
gets here twice (directly and forwarded by make), and reaches the servers too, which stay in
this process's group. The first SIGTERM/SIGINT starts a bounded stop (SIGTERM each child,
SIGKILL what outlives 5 s); later ones are only noted. Exit status: 0 after a requested stop,
1 when a server failed to start or died, 2 for a bad or busy ``PORT_BASE`` or a bad argument.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import secrets
import signal
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType

from .crash_scenario import WORKER_HEALTHCHECK_SECONDS, start_timeout
from .deployment import (
    PORT_SPAN,
    TOKEN_ENV,
    Deployment,
    DeploymentAborted,
    DeploymentError,
    parse_port_base,
    port_is_free,
)
from .gym_config import PORT_OFFSETS, wrapped_entrypoints

__all__ = ["main"]

DEFAULT_PORT_BASE = 18000
# How often the foreground loop checks that every server is still alive.
_WATCH_SECONDS = 0.5


def _num_workers() -> int:
    raw = os.environ.get("NUM_WORKERS", "").strip()
    if not raw:
        return 1
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"NUM_WORKERS must be a positive integer, not {raw!r}")
    return int(raw)


def _port_base() -> int:
    """``PORT_BASE`` from the environment; ``ValueError`` naming the variable when it is unusable."""
    return parse_port_base(os.environ.get("PORT_BASE") or str(DEFAULT_PORT_BASE))


def _claim(work_dir: Path, port_base: int) -> int:
    """Lock ``work_dir`` for this serve and check its ports; ``RuntimeError`` when another one has them.

    Runs before anything is written: a second serve on the same ``PORT_BASE`` must leave the running
    one's token and config alone. The lock covers a first serve still starting (ports not bound yet);
    the port check covers a first serve with another ``NG_SERVE_DIR`` and any other program.
    """
    # The descriptor stays open (and locked) until this process exits; children do not inherit it.
    fd = os.open(work_dir / "serve.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(
            f"another serve is running with PORT_BASE={port_base} (it holds {work_dir / 'serve.lock'}); "
            "stop it, or choose another PORT_BASE"
        ) from None
    taken = sorted(port_base + offset for offset in PORT_OFFSETS.values() if not port_is_free(port_base + offset))
    if taken:
        os.close(fd)
        raise RuntimeError(
            f"PORT_BASE={port_base} is busy: 127.0.0.1 port(s) {taken} already in use; "
            f"choose another PORT_BASE (serve uses {PORT_SPAN} consecutive ports)"
        )
    return fd


def _ensure_token(work_dir: Path) -> Path | None:
    """The token file written, or None when the token came from the environment."""
    if os.environ.get(TOKEN_ENV):
        return None
    token = secrets.token_urlsafe(32)
    # Children copy os.environ, so this is how every server gets the token.
    os.environ[TOKEN_ENV] = token
    token_path = work_dir / "token"
    token_path.unlink(missing_ok=True)
    fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    print(f"serve: {TOKEN_ENV} was unset; generated a token, written to {token_path}", file=sys.stderr)
    return token_path


def main(argv: list[str] | None = None) -> int:
    # No options (the environment configures it); argparse gives ``--help`` and refuses stray arguments.
    argparse.ArgumentParser(
        prog="python -m nemo_gym_checkpoint_plugin.testing.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args(argv)
    try:
        port_base = _port_base()
        num_workers = _num_workers()
    except ValueError as bad:
        print(f"serve: {bad}", file=sys.stderr)
        return 2
    default_dir = Path(tempfile.gettempdir()) / f"nemo-gym-checkpoint-serve-{port_base}"
    work_dir = Path(os.environ.get("NG_SERVE_DIR") or default_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        _claim(work_dir, port_base)
    except RuntimeError as busy:
        print(f"serve: {busy}", file=sys.stderr)
        return 2

    stop = threading.Event()

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        # Only set a flag: the handler may run while a child is being spawned or reaped, and a second
        # signal (make forwards the group's SIGTERM) must never interrupt the stop already under way.
        if stop.is_set():
            print(f"serve: {signal.Signals(signum).name} again; already stopping", file=sys.stderr)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)

    real_stdout = sys.stdout
    # Gym's config parser and the servers may print; stdout carries only the one JSON line.
    with contextlib.redirect_stdout(sys.stderr):
        token_file = _ensure_token(work_dir)
        try:
            # Every Gym server through the wrapper: each one a checkpoint participant.
            workers = {"num_workers": num_workers} if num_workers > 1 else None
            deployment = Deployment(
                port_base,
                work_dir,
                entrypoints=wrapped_entrypoints(),
                own_process_groups=False,
                log_dir=None,
                model=workers,
                resources=workers,
                environment=workers,
                gym_settings={"uvicorn_timeout_worker_healthcheck": WORKER_HEALTHCHECK_SECONDS} if workers else None,
            )
            deployment.start_timeout = start_timeout(num_workers)
            config_path = deployment.write_config(work_dir / "gym_config.yaml")
            deployment.start(abort=stop)
        except DeploymentAborted:
            print("serve: stopped before every server was ready", file=sys.stderr)
            return 0
        except DeploymentError as failed:
            print(f"serve: {failed}", file=sys.stderr)
            return 1

    line = {
        "servers": deployment.urls,
        "token_env": TOKEN_ENV,
        "config": str(config_path),
        "token_file": None if token_file is None else str(token_file),
    }
    print(json.dumps(line), file=real_stdout, flush=True)

    status = 0
    try:
        while not stop.wait(_WATCH_SECONDS):
            dead = deployment.dead()
            if dead:
                print(f"serve: servers exited unexpectedly: {dead}; stopping the rest", file=sys.stderr)
                status = 1
                break
    finally:
        deployment.stop()
    print("serve: every server stopped", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
