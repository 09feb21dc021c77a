"""Every process a test run starts dies with the run, however the run ends.

Tests start real servers, each leading its own process group (so a test can SIGKILL a whole
server), and ``ng_run`` starts Ray's daemons in sessions of their own. When pytest itself is
killed (a CI timeout, Ctrl-C twice, SIGKILL), no ``finally`` runs and those processes outlive it,
holding ports and gigabytes until someone kills them by hand.

So a run marks itself: ``NG_CHECKPOINT_TEST_RUN=<a fresh id>`` in its environment before any test
starts, which every process it starts inherits (directly or through Gym, Ray and uvicorn, which
pass their environment on). Two things then kill every process carrying the run's id:

- at the end of the session (pytest's last hook), whatever a test left running;
- a watchdog, a small process in a session of its own started at the beginning, which waits for
  pytest to exit (a ``pidfd``: no polling) and then does the same: this covers a pytest that
  never reached its last hook.

A nested run (a test that runs pytest) marks its own processes with its own id; the outer run's
sweep kills them too, since the inner pytest carries the outer id. Loaded by the testing kit's
pytest plugin, so a participant's own test suite gets it as well.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import sys
import uuid
from pathlib import Path

__all__ = ["MARKER", "marked_processes", "start_watchdog", "sweep"]

MARKER = "NG_CHECKPOINT_TEST_RUN"
_PROC = Path("/proc")
_ROUNDS = 20  # a process may start another while the sweep kills: sweep again until none is left


def marked_processes(run: str, exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Pids whose environment (as they were started) carries ``MARKER=run``, but ``exclude``."""
    needle = f"{MARKER}={run}".encode()
    found = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        try:
            environment = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone meanwhile, or another user's
        if needle in environment.split(b"\0"):
            found.append(int(entry.name))
    return found


def sweep(run: str) -> list[int]:
    """SIGKILL every process of the run but this one; returns the pids killed."""
    killed: list[int] = []
    for _round in range(_ROUNDS):
        pids = marked_processes(run, exclude={os.getpid()})
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        for pid in pids:
            # Reap our own children (a zombie keeps its /proc entry); others are reaped by their parent or init.
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
    return sorted(set(killed))


def start_watchdog(run: str, pid: int | None = None) -> int:
    """Start the watchdog of ``pid`` (this process by default): it sweeps ``run`` once ``pid`` has exited.

    It runs in a session of its own, so a signal to pytest's process group does not reach it, and
    without the marker, so no sweep kills it. Spawned without a ``Popen`` (which would warn at exit
    about a child still running: the watchdog outlives pytest by design); returns its pid.
    """
    environment = {key: value for key, value in os.environ.items() if key != MARKER}
    argv = [sys.executable, "-m", __name__, "--watch", str(os.getpid() if pid is None else pid), "--run", run]
    quiet = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    return os.posix_spawn(sys.executable, argv, environment, file_actions=quiet, setsid=True)


def new_run() -> str:
    """Mark this process's environment with a fresh run id (children inherit it); returns it."""
    run = uuid.uuid4().hex
    os.environ[MARKER] = run
    return run


def _watch(pid: int, run: str) -> int:
    try:
        descriptor = os.pidfd_open(pid)
    except ProcessLookupError:
        descriptor = None  # already gone
    if descriptor is not None:
        select.select([descriptor], [], [])  # readable once the process has exited
        os.close(descriptor)
    sweep(run)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Kill every process of a test run once its pytest has exited.")
    parser.add_argument("--watch", type=int, required=True, metavar="PID", help="the pytest process to wait for")
    parser.add_argument("--run", required=True, help=f"the run's id (the value of {MARKER})")
    args = parser.parse_args(argv)
    return _watch(args.watch, args.run)


if __name__ == "__main__":
    sys.exit(main())
