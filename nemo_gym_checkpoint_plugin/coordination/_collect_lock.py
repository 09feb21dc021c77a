"""One collection per checkpoint directory: ``<checkpoint-dir>/collect.lock``, held for the whole run.

Two collectors on one directory lost rows: each pruned the other's checkpoints, both resumed from
the same checkpoint and ran its rows twice. ``CollectionLock`` makes the second one refuse at once:

- the lock is an exclusive ``flock`` on ``collect.lock`` (created ``0600``, never through a
  symlink), held by the collector process from before it touches a server until it exits; the
  kernel drops it when the process dies, whatever killed it;
- the file says who holds it (``owner``, ``host``, ``pid`` and the process's start time, ``run``,
  ``output``, ``since``), written once the lock is taken, emptied when it is released: a refused
  collector names the holder;
- a lock whose holder is gone is **stale**: taken over, and ``acquire`` returns the holder it
  replaces (the caller says so, and knows the dead collector's owner id and run). Gone means: the
  ``flock`` is free and the file names a process of this host that no longer runs (or another
  process now has its pid). A file naming a process on another host whose ``flock`` is free is
  refused all the same (the filesystem may not share locks between hosts): the message says to
  remove the file once that collector is known to be gone;
- the file is never deleted (an unlinked lock file lets two processes lock two inodes of one name).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from .._process import pid_alive

__all__ = ["LOCK_NAME", "CollectionLock", "DirectoryLocked", "Holder", "collector_owner"]

LOCK_NAME = "collect.lock"
_MAX_LOCK_BYTES = 64 * 1024


def collector_owner(run: str) -> str:
    """The owner id of the collector of ``run`` on this host (what its lock and its deployment lease name)."""
    return f"collect-{run}@{socket.gethostname()}"


def _process_start(pid: int) -> str | None:
    """The start time of ``pid`` (``/proc/<pid>/stat`` field 22), telling a reused pid apart; None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) is parenthesised and may hold spaces: count fields after its end.
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def _alive(pid: int, started: str | None) -> bool:
    if not pid_alive(pid):
        return False
    now = _process_start(pid)
    return started is None or now is None or now == started


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a checkpoint directory's lock."""

    owner: str
    host: str
    pid: int
    run: str = ""
    output: str = ""
    since: float = 0.0
    pid_start: str | None = None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since)) if self.since else "an unknown time"
        into = f", collecting into {self.output}" if self.output else ""
        return f"collector {self.owner} (pid {self.pid} on host {self.host}, since {when}{into})"

    def on_this_host(self) -> bool:
        return self.host == socket.gethostname()

    def gone(self) -> bool:
        """The holder's process no longer runs (known only for a holder on this host)."""
        return self.on_this_host() and not _alive(self.pid, self.pid_start)

    @classmethod
    def parse(cls, raw: bytes) -> Holder | None:
        try:
            data = orjson.loads(raw)
            return cls(
                owner=str(data["owner"]),
                host=str(data["host"]),
                pid=int(data["pid"]),
                run=str(data.get("run") or ""),
                output=str(data.get("output") or ""),
                since=float(data.get("since") or 0.0),
                pid_start=data.get("pid_start"),
            )
        except (ValueError, KeyError, TypeError):
            return None


class DirectoryLocked(Exception):
    """Another collector holds the checkpoint directory (``holder``: who, None if its file is unreadable)."""

    def __init__(self, path: Path, holder: Holder | None, why: str) -> None:
        self.path = path
        self.holder = holder
        super().__init__(why)


def _read(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, _MAX_LOCK_BYTES)


class CollectionLock:
    """The lock of ``root`` for one collector (``owner``, ``run``, collecting into ``output``)."""

    def __init__(self, root: str | Path, owner: str, run: str, output: str) -> None:
        self.path = Path(root) / LOCK_NAME
        self.me = Holder(
            owner=owner,
            host=socket.gethostname(),
            pid=os.getpid(),
            run=run,
            output=output,
            since=time.time(),
            pid_start=_process_start(os.getpid()),
        )
        self._fd: int | None = None

    def acquire(self) -> Holder | None:
        """Take the lock; returns the stale holder it took over (None if it was free).

        Raises ``DirectoryLocked`` naming the holder when a live collector (or one this host cannot
        tell is gone) holds it; ``OSError`` when the file cannot be made.
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                holder = Holder.parse(_read(fd))
                who = holder.describe() if holder else "another collector (its lock file is being written)"
                raise DirectoryLocked(self.path, holder, f"{who} holds it") from None
            previous = Holder.parse(_read(fd))
            if previous is not None and not previous.gone():
                where = (
                    "on another host, so this host cannot tell whether it still runs; once it is known to be "
                    f"gone, remove {self.path}"
                    if not previous.on_this_host()
                    else "its process runs, yet it does not hold the lock"
                )
                raise DirectoryLocked(self.path, previous, f"{previous.describe()} holds it ({where})")
            os.ftruncate(fd, 0)
            os.pwrite(fd, orjson.dumps(asdict(self.me)) + b"\n", 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return previous

    def release(self) -> None:
        """Empty the file (released) and drop the lock; never deletes the file."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass  # the lock goes with the descriptor all the same
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> CollectionLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
