"""The runtime directory of one multi-worker server process: where its Unix sockets live.

One directory per server process, ``/tmp/ngck-<pid>-<random>``, mode 0700 (only this user can
reach the sockets), removed when the process exits. It is under ``/tmp`` and not
``$TMPDIR`` on purpose: a Unix socket path holds at most 107 bytes, and a deep ``$TMPDIR``
(pytest's, a job scheduler's) would not leave room for one.

A server killed with SIGKILL leaves its directory behind, so creating one first sweeps the
directories of dead servers. ``/tmp`` may be shared with other containers, whose processes this
one cannot see: a pid that is gone here may be alive there. So a directory is removed only when
both hold:

- its pid (in its name) is not a live process here (``kill(pid, 0)`` says no such process), and
- none of its sockets accepts a connection (each refuses, or its file is gone).

Anything that cannot be proved dead (a pid that exists, a socket that accepts or cannot be
tried, a directory that cannot be read, one owned by another user, a symlink) is kept, and
nothing is ever removed for its age.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .._process import pid_alive

__all__ = [
    "PREFIX",
    "RUNTIME_ROOT",
    "SOCKET_PATH_MAX",
    "RuntimeDir",
    "create_runtime_dir",
    "pid_alive",
    "socket_accepts",
    "sweep_dead",
]

logger = logging.getLogger(__name__)

RUNTIME_ROOT = Path("/tmp")
PREFIX = "ngck-"
# sockaddr_un.sun_path is 108 bytes, one of them the terminating NUL.
SOCKET_PATH_MAX = 107
# How long a sweep waits for one socket to accept before counting it as alive (a full backlog).
_PROBE_SECONDS = 0.5

_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-[A-Za-z0-9_]+$")


def socket_accepts(path: str | os.PathLike[str]) -> bool:
    """Whether something listens on the Unix socket ``path``; True too when that cannot be ruled out.

    Only a refused connection or a missing file prove that nothing listens.
    """
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(_PROBE_SECONDS)
    try:
        probe.connect(os.fspath(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # a full backlog (timeout), no permission, a path too long: not proved dead
    finally:
        probe.close()
    return True


def _any_socket_accepts(directory: Path) -> bool:
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return True  # cannot look inside: keep it
    for entry in entries:
        try:
            is_socket = stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode)
        except FileNotFoundError:
            continue
        except OSError:
            return True
        if is_socket and socket_accepts(entry.path):
            return True
    return False


def _dead_directory(entry: os.DirEntry[str]) -> bool:
    match = _NAME.match(entry.name)
    if match is None:
        return False
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return False
    if pid_alive(int(match.group(1))):
        return False
    return not _any_socket_accepts(Path(entry.path))


def sweep_dead(root: str | os.PathLike[str] = RUNTIME_ROOT) -> list[Path]:
    """Remove the runtime directories under ``root`` left by dead servers (module docstring); return them."""
    removed: list[Path] = []
    try:
        entries = [entry for entry in os.scandir(root) if entry.name.startswith(PREFIX)]
    except OSError as exc:
        logger.warning("cannot sweep runtime directories in %s: %s", root, exc)
        return removed
    for entry in entries:
        if not _dead_directory(entry):
            continue
        failures: list[str] = []

        def _record(_function: object, path: str, exc: BaseException, failures: list[str] = failures) -> None:
            if not isinstance(exc, FileNotFoundError):  # another server sweeping at the same time
                failures.append(f"{path}: {exc}")

        shutil.rmtree(entry.path, onexc=_record)
        if failures:
            logger.warning("could not remove the dead runtime directory %s: %s", entry.path, "; ".join(failures))
        else:
            removed.append(Path(entry.path))
    return removed


@dataclass
class RuntimeDir:
    """One server process's runtime directory. ``remove`` deletes it, only from the process that made it."""

    path: Path
    owner_pid: int
    swept: list[Path] = field(default_factory=list)

    def socket_path(self, name: str) -> str:
        """The path of socket ``name`` in this directory; ``ValueError`` when it is too long for a Unix socket."""
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"a socket name is one path component, not {name!r}")
        path = os.path.join(self.path, name)
        if len(os.fsencode(path)) > SOCKET_PATH_MAX:
            raise ValueError(f"socket path {path!r} is longer than {SOCKET_PATH_MAX} bytes")
        return path

    def remove(self) -> None:
        """Delete the directory and everything in it (idempotent); a no-op in any other process (a fork)."""
        if os.getpid() != self.owner_pid:
            return
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> RuntimeDir:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.remove()


def create_runtime_dir(root: str | os.PathLike[str] = RUNTIME_ROOT, *, remove_at_exit: bool = True) -> RuntimeDir:
    """Sweep ``root`` (``sweep_dead``), then create this process's directory there, mode 0700.

    With ``remove_at_exit`` it is removed when the interpreter exits (``atexit``); a SIGKILL leaves
    it for the next sweep.
    """
    swept = sweep_dead(root)
    pid = os.getpid()
    # mkdtemp creates the directory 0700 and never reuses a name.
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{pid}-", dir=os.fspath(root)))
    os.chmod(path, 0o700)
    runtime = RuntimeDir(path=path, owner_pid=pid, swept=swept)
    if remove_at_exit:
        atexit.register(runtime.remove)
    return runtime
