"""A network namespace holding only a loopback interface, for tests whose processes must not reach any other.

``LoopbackNamespace`` runs one worker thread that unshares a new network namespace
(``unshare(CLONE_NEWNET)``, root only) and brings its ``lo`` up; an event loop runs in that
thread. Everything the test does there (HTTP calls, and every process it spawns, since a
child inherits the namespace of the thread that forks it) sees only 127.0.0.1 of that
namespace: there is no other interface to bind or to send to. Used for Gym's own launcher,
which starts a Ray cluster: Ray picks its node address by reaching out to the network, and
here it can only fall back to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import socket
import struct
import subprocess
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

__all__ = ["LoopbackNamespace", "namespaces_supported"]

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
# /proc/net/tcp{,6} addresses of a LISTEN socket (state 0A) bound to loopback only.
_LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | _IFF_UP, b""))


def namespaces_supported() -> bool:
    """Whether this process may create a network namespace (root, unshare allowed)."""
    if not hasattr(os, "unshare") or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


class LoopbackNamespace:
    """A fresh network namespace with ``lo`` only; ``run``/``popen`` execute inside it."""

    def __init__(self) -> None:
        self.inode = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="loopback-netns", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError("the namespace thread did not start within 30 s")
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        try:
            os.unshare(os.CLONE_NEWNET)
            _loopback_up()
            self.inode = os.stat("/proc/thread-self/ns/net").st_ino
            self.loop = asyncio.new_event_loop()
        except BaseException as exc:  # reported to the constructor, which raises it
            self._error = exc
            self._ready.set()
            return
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()
        self.loop.close()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        """Run ``coro`` on the namespace's loop and return its result (bounded by ``timeout``)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start a process inside the namespace (forked from its thread)."""

        async def spawn() -> subprocess.Popen:
            return subprocess.Popen(list(argv), **kwargs)

        return self.run(spawn(), timeout=60)

    def command(self, argv: Sequence[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
        """Run a command inside the namespace to completion, capturing its output as text."""

        async def complete() -> subprocess.CompletedProcess:
            process = await asyncio.create_subprocess_exec(
                *argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs
            )
            out, err = await asyncio.wait_for(process.communicate(), timeout)
            return subprocess.CompletedProcess(list(argv), process.returncode or 0, out.decode(), err.decode())

        return self.run(complete(), timeout + 30)

    def processes(self) -> list[int]:
        """Pids of every process whose network namespace is this one (this test process excluded)."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == self.inode:
                    found.append(int(entry))
            except OSError:
                continue  # gone meanwhile, or not ours to look at
        return found

    def listening(self, pid: int) -> list[tuple[str, int]]:
        """(hex address, port) of every TCP socket listening in the namespace, read through ``pid``'s /proc."""
        found = []
        for table in ("tcp", "tcp6"):
            with open(f"/proc/{pid}/net/{table}", encoding="ascii") as handle:
                for line in handle.readlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A":
                        address, port = fields[1].split(":")
                        found.append((address, int(port, 16)))
        return found

    @staticmethod
    def is_loopback(address: str) -> bool:
        return address in _LOOPBACK

    def close(self) -> None:
        if self.loop is not None and self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
