"""A warm interpreter that forks test servers, so each skips the import of Gym's libraries.

Every Gym server imports nemo_gym's base modules, which pull in pandas, scipy, openai, anthropic and
wandb: 4-5 s of CPU per server, most of a real-process test's time on a small machine. The zygote
imports those once; each server is then a child forked from it that runs its entrypoint as
``python <argv>`` would (``runpy`` as ``__main__``, its argv, cwd, environment and ``sys.path``, its
own session, stdout and stderr). The children are real processes with pids of their own: SIGKILL
kills them, and they leave through the interpreter's normal exit (atexit handlers run).

Preloaded is only what reads nothing at import: third-party libraries and nemo_gym's base modules
(Gym reads its configuration when a server starts, not on import). The plugin itself is not
preloaded: each child imports it under its own environment.

``Zygote.spawn`` returns a ``ForkedProcess``, which answers ``pid``, ``returncode``, ``poll``,
``wait``, ``send_signal``, ``terminate`` and ``kill`` as ``subprocess.Popen`` does (the zygote is
the parent that reaps; a pidfd keeps signals from reaching a reused pid). ``Deployment`` uses it when
given ``spawner=``; the testing kit's pytest plugin gives it one for the session unless
``NG_CHECKPOINT_TEST_ZYGOTE=0``. ``make demo`` and ``make serve`` always start plain processes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

__all__ = ["ForkedProcess", "Zygote", "ZygoteError", "PRELOAD"]

# What each Gym server would import for itself (nemo_gym's base servers and what they pull in).
PRELOAD = (
    "nemo_gym.server_utils",
    "nemo_gym.base_resources_server",
    "nemo_gym.base_responses_api_model",
    "nemo_gym.base_responses_api_agent",
    "nemo_gym.openai_utils",
    "nemo_gym.rollout_collection",  # a collector (ng-checkpoint collect) a test starts
    # What the wheel's servers (the demo deployment's four) import next: the four start on 12% less CPU
    # (1.84 s instead of 2.09 s on this project's 2-core machine), and `make fuzz` restarts them
    # (SIGKILL, then fresh processes) several times a sequence.
    "nemo_gym.base_environment_server",
    "nemo_gym.responses_converter",
    "nemo_gym.single_agent_turn_types",
    "nemo_gym.telemetry.contrib",
    "nemo_gym.telemetry.metrics",
    "nemo_gym.token_id_capture.external_capture",
    "nemo_gym.verifier_fixture",
    "uvicorn",
    "fastapi",
    "pydantic.v1",  # FastAPI imports it on the first route it builds
    "aiohttp",
)
# Libraries that start threads at import (OpenBLAS's workers, pyarrow's jemalloc background thread,
# which pandas brings in): a process that forks must have none.
_SINGLE_THREADED = {
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "JE_ARROW_MALLOC_CONF": "background_thread:false",
}
_READY = b"zygote ready\n"
_MAX_REQUEST = 64 * 1024 * 1024


class ZygoteError(RuntimeError):
    """The zygote could not start, or refused or failed a request."""


# -- the zygote process ----------------------------------------------------------------------------


@dataclass
class _Child:
    """What a freshly forked child runs (the request it was forked for, and its stdout/stderr)."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    session: bool
    stdout: int
    stderr: int


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 2)
    buffer = bytearray(data)
    while not buffer.endswith(b"\n"):
        chunk = conn.recv(1 << 20)
        if not chunk:
            raise ZygoteError("request ended before its newline")
        buffer += chunk
        if len(buffer) > _MAX_REQUEST:
            raise ZygoteError("request too large")
    return orjson.loads(buffer), list(fds)


def _reply(conn: socket.socket, body: Mapping[str, Any]) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(orjson.dumps(body) + b"\n")


def _serve(path: str, parent: int) -> _Child | None:
    """Answer requests until the parent exits (returns None) or a fork returns in the child."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    parent_fd = os.pidfd_open(parent)
    statuses: dict[int, int | None] = {}  # child pid -> exit status (Popen's returncode), None while running

    def reap(pid: int = -1, block: bool = False) -> None:
        while True:
            try:
                found, status = os.waitpid(pid, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            if found == 0:
                return
            statuses[found] = os.waitstatus_to_exitcode(status)
            if pid != -1:
                return

    os.write(1, _READY)
    while True:
        readable, _, _ = select.select([listener.fileno(), parent_fd], [], [], 1.0)
        reap()  # zombies are reaped even when nobody asks
        if parent_fd in readable:
            return None
        if listener.fileno() not in readable:
            continue
        conn, _ = listener.accept()
        with conn:
            try:
                request, fds = _read_request(conn)
            except (OSError, ValueError, ZygoteError) as exc:
                _reply(conn, {"error": f"unreadable request: {exc}"})
                continue
            op = request.get("op")
            if op == "spawn":
                if len(fds) != 2:
                    for fd in fds:
                        os.close(fd)
                    _reply(conn, {"error": "spawn needs two descriptors (stdout, stderr)"})
                    continue
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    os.close(parent_fd)
                    conn.close()
                    return _Child(
                        argv=list(request["argv"]),
                        cwd=str(request["cwd"]),
                        env=dict(request["env"]),
                        session=bool(request["session"]),
                        stdout=fds[0],
                        stderr=fds[1],
                    )
                for fd in fds:
                    os.close(fd)
                statuses[pid] = None
                _reply(conn, {"pid": pid})
            elif op in ("poll", "wait"):
                pid = int(request["pid"])
                if pid not in statuses:
                    _reply(conn, {"error": f"{pid} is not a child of this zygote"})
                    continue
                if statuses[pid] is None:
                    # "wait" comes once the caller saw the process exit: reaping it cannot block for long.
                    reap(pid, block=op == "wait")
                _reply(conn, {"returncode": statuses[pid]})
            else:
                _reply(conn, {"error": f"unknown op {op!r}"})


def _run_child(child: _Child, base_path: list[str]) -> int:
    """Become ``python <child.argv[1:]>``: session, descriptors, cwd, environment, sys.path, then run."""
    if child.session:
        os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(child.stdout, 1)
    os.dup2(child.stderr, 2)
    for fd in {devnull, child.stdout, child.stderr} - {0, 1, 2}:
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(child.cwd)
    os.environ.clear()
    os.environ.update(child.env)
    args = child.argv[1:]
    extra = [p for p in child.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    try:
        if args[0] == "-m":
            sys.path[:] = [os.getcwd(), *extra, *base_path]
            sys.argv = [args[1], *args[2:]]  # run_module sets argv[0] to the module's file, as -m does
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(args[0])
            sys.path[:] = [os.path.dirname(script), *extra, *base_path]
            sys.argv = [args[0], *args[1:]]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Preload Gym's libraries, then fork test servers on request.")
    parser.add_argument("--socket", required=True, help="the Unix socket to listen on")
    parser.add_argument("--parent", type=int, required=True, help="exit once this process has exited")
    args = parser.parse_args(argv)
    # A Ctrl-C reaches the whole process group, this process too: it ends with its parent instead, so the
    # parent's clean-up after the interrupt can still ask it to reap the servers it forked.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    base_path = list(sys.path)  # started with -P and no PYTHONPATH: the interpreter's own entries only
    for module in PRELOAD:
        __import__(module)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1 or threading.active_count() != 1:
        print(f"zygote: {threads} threads after the preload; a process that forks must have one", file=sys.stderr)
        return 3
    # The preload leaves a heap whose young generations are full and whose oldest generation is owed a full
    # collection: each child paid for it (a full collection walks the whole inherited heap, and writing the
    # objects' GC headers copies every page it touches), about half a server's start. Collected once here,
    # every child starts with all of it in the oldest generation and nothing owed, as a fresh interpreter
    # would after a collection. Not frozen: the plugin's own heap holds (``_gc_pause``) must see an
    # unfrozen heap, as in production.
    gc.collect()
    child = _serve(args.socket, args.parent)
    if child is None:
        return 0
    return _run_child(child, base_path)


# -- the test process's side ---------------------------------------------------------------------


class ForkedProcess:
    """A child of the zygote, answering as ``subprocess.Popen`` does for what tests and ``Deployment`` use."""

    def __init__(self, zygote: Zygote, pid: int, args: Sequence[str]) -> None:
        self._zygote = zygote
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._pidfd: int | None = os.pidfd_open(pid)

    def _done(self, code: int) -> int:
        self.returncode = code
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return code

    def _exited(self, timeout: float | None) -> bool:
        assert self._pidfd is not None
        readable, _, _ = select.select([self._pidfd], [], [], timeout)
        return bool(readable)

    def poll(self) -> int | None:
        if self.returncode is None and self._exited(0):
            self._done(self._zygote.request({"op": "wait", "pid": self.pid})["returncode"])
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        if not self._exited(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        return self._done(self._zygote.request({"op": "wait", "pid": self.pid})["returncode"])

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        if getattr(self, "_pidfd", None) is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)  # type: ignore[arg-type]


class Zygote:
    """The zygote process, started at construction; ``spawn`` forks a server from it, ``close`` ends it."""

    def __init__(self, python: str = sys.executable, timeout: float = 120.0) -> None:
        self.python = python
        self._dir = tempfile.TemporaryDirectory(prefix="ng-zygote-")
        self.socket_path = str(Path(self._dir.name) / "zygote.sock")
        environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        environment.update(_SINGLE_THREADED)
        self._proc = subprocess.Popen(
            [python, "-P", "-u", "-m", __name__, "--socket", self.socket_path, "--parent", str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env=environment,
            cwd=self._dir.name,
        )
        assert self._proc.stdout is not None
        readable, _, _ = select.select([self._proc.stdout], [], [], timeout)
        line = self._proc.stdout.readline() if readable else b""
        if line != _READY:
            self.close()
            raise ZygoteError(f"the zygote did not start within {timeout} s (printed {line!r})")
        self._lock = threading.Lock()

    def request(self, body: Mapping[str, Any], fds: Sequence[int] = ()) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30.0)
            conn.connect(self.socket_path)
            socket.send_fds(conn, [orjson.dumps(body) + b"\n"], list(fds))
            buffer = bytearray()
            while not buffer.endswith(b"\n"):
                chunk = conn.recv(1 << 16)
                if not chunk:
                    raise ZygoteError(f"the zygote closed the connection without a reply to {body.get('op')}")
                buffer += chunk
        reply: dict[str, Any] = orjson.loads(buffer)
        if "error" in reply:
            raise ZygoteError(reply["error"])
        return reply

    def can_run(self, argv: Sequence[str]) -> bool:
        """True when ``argv`` is ``<this python> <script.py> ...`` or ``<this python> -m <module> ...``."""
        if len(argv) < 2 or argv[0] != self.python or self._proc.poll() is not None:
            return False
        if argv[1] == "-m":
            return len(argv) >= 3
        return not argv[1].startswith("-")

    def spawn(
        self,
        argv: Sequence[str],
        *,
        cwd: str | os.PathLike[str],
        env: Mapping[str, str],
        stdout: int,
        stderr: int,
        start_new_session: bool,
    ) -> ForkedProcess:
        """Fork ``argv`` (see ``can_run``) with this cwd, environment and descriptors; returns the child."""
        if not self.can_run(argv):
            raise ZygoteError(f"the zygote cannot run {list(argv)}")
        body = {
            "op": "spawn",
            "argv": list(argv),
            "cwd": os.fspath(cwd),
            "env": dict(env),
            "session": start_new_session,
        }
        reply = self.request(body, fds=(stdout, stderr))
        return ForkedProcess(self, int(reply["pid"]), argv)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._dir.cleanup()


if __name__ == "__main__":
    sys.exit(main())
