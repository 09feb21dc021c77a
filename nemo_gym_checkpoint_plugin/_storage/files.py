"""Careful file access for checkpoint storage: regular files only, typed write failures, leftovers.

A checkpoint directory may hold anything (a FIFO where a manifest should be, a directory
where a records file should be). Every file the storage reads is opened with
``O_NONBLOCK | O_NOFOLLOW`` (opening a FIFO then never waits for a writer), checked with
``fstat`` to be a regular file before a byte is read, and closed on every path.

Records hold session data, so every file the storage creates (records files, manifests,
``participants.json``) is readable and writable by its owner only (``0600``), and every
directory it creates is ``0700``; directories that already exist are left as they are.

Every ``OSError`` while storing becomes ``WriteFailed`` naming the cause in words and the
path, so a caller can tell a filesystem that refused the write (the export is kept and
a retry may succeed elsewhere) from an export that cannot be stored at all.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
from pathlib import Path

from .._errors import InvalidCheckpointState, WriteFailed

__all__ = [
    "DIRECTORY_MODE",
    "FILE_MODE",
    "DirectoryLock",
    "LEFTOVER",
    "cause_in_words",
    "create_private",
    "make_private_dirs",
    "open_regular",
    "read_regular",
    "write_failed",
]

# What a writer that died (or was stopped before this fix) may leave in a participant directory.
LEFTOVER = re.compile(r"^(\.records\.[0-9a-f]+\.tmp|\.manifest\.[0-9a-f]+\.tmp|records(-[0-9a-f]{64})?\.jsonl)$")

_READ_CHUNK = 1 << 16

# Owner only: records and manifests hold session data (prompts, tool state) of every episode.
FILE_MODE = 0o600
DIRECTORY_MODE = 0o700


def create_private(path: Path | str, buffering: int = -1):  # noqa: ANN201 - a binary file object
    """Create ``path`` (never an existing file, never through a symlink) mode ``0600``, open for binary writing."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        # The umask can only take bits away; fchmod makes the mode exactly 0600 whatever it is.
        os.fchmod(fd, FILE_MODE)
        return os.fdopen(fd, "wb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def make_private_dirs(path: Path, base: Path | None = None) -> None:
    """``mkdir -p path``, each directory it creates mode ``0700`` (``Path.mkdir`` gives parents the default).

    With ``base`` (an ancestor of ``path``, the checkpoint directory a controller named), every
    component below it is created and entered relative to its parent's descriptor without ever
    following a symbolic link (``O_NOFOLLOW``): a link planted there (by another user able to write
    the directory) is refused with ``ELOOP``, never written through. ``base`` itself may be reached
    through links, as the controller gave it.
    """
    if base is not None:
        _make_private_below(Path(base), Path(path).relative_to(base).parts)
        return
    missing: list[Path] = []
    probe = path
    while not os.path.lexists(probe) and probe.parent != probe:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=DIRECTORY_MODE)
        except FileExistsError:
            continue  # another writer made it first: its mode is that writer's (also 0700)
        os.chmod(directory, DIRECTORY_MODE)
    if missing:
        return
    if not path.is_dir():
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))


def _make_private_below(base: Path, parts: tuple[str, ...]) -> None:
    make_private_dirs(base)
    where = base
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in parts:
            where = where / name
            try:
                os.mkdir(name, DIRECTORY_MODE, dir_fd=fd)
                created = True
            except FileExistsError:
                created = False  # another writer made it first (0700 too), or something else is there
            try:
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                # O_NOFOLLOW | O_DIRECTORY on a link says ELOOP or ENOTDIR: told apart, named by its path.
                link = stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
                code = errno.ELOOP if link else (exc.errno or errno.ENOTDIR)  # os.open always sets errno
                raise OSError(code, os.strerror(code), str(where)) from None
            if created:
                os.fchmod(child, DIRECTORY_MODE)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)


_CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only filesystem",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOTDIR: "not a directory",
    errno.EEXIST: "already exists and is not a directory",
    errno.EISDIR: "is a directory",
    errno.EIO: "input/output error",
    errno.ENAMETOOLONG: "file name too long",
    errno.ELOOP: "a symbolic link where a directory must be (never followed inside a checkpoint)",
}


def cause_in_words(exc: OSError) -> str:
    """The cause of a filesystem failure in words (``no space left on device``, ...)."""
    if exc.errno in _CAUSES:
        return _CAUSES[exc.errno]
    return (exc.strerror or type(exc).__name__).lower()


def write_failed(exc: OSError, path: Path | str, what: str = "cannot store the checkpoint") -> WriteFailed:
    """``WriteFailed`` for an ``OSError`` while storing: ``<path>: <what>: <cause>``."""
    where = exc.filename if exc.filename is not None else path
    cause = cause_in_words(exc)
    return WriteFailed(f"{where}: {what}: {cause}", path=str(where), cause=cause)


def open_regular(path: Path, directory: Path, what: str) -> int:
    """Open ``path`` for reading without blocking and return the fd, or refuse it.

    Refuses (``InvalidCheckpointState`` naming ``what``) a missing file, a symbolic link,
    anything but a regular file (FIFO, directory, device, socket); the fd is closed on
    every refusal. ``O_NONBLOCK`` makes opening a FIFO return at once; on a regular file
    it changes nothing.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidCheckpointState(f"{directory}: {what} is missing", directory=str(directory)) from None
    except OSError as exc:
        raise InvalidCheckpointState(
            f"{directory}: {what} cannot be opened: {cause_in_words(exc)}", directory=str(directory)
        ) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InvalidCheckpointState(
                f"{directory}: {what} is not a regular file ({_file_type(mode)})", directory=str(directory)
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _file_type(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def read_regular(path: Path, directory: Path, what: str, limit: int) -> bytes:
    """The whole content of a small regular file, refusing one longer than ``limit`` bytes."""
    fd = open_regular(path, directory, what)
    chunks: list[bytes] = []
    size = 0
    try:
        # In chunks: one read(limit + 1) would allocate the whole bound up front, however small the file.
        while size <= limit and (chunk := os.read(fd, min(_READ_CHUNK, limit + 1 - size))):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise InvalidCheckpointState(
            f"{directory}: {what} cannot be read: {cause_in_words(exc)}", directory=str(directory)
        ) from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise InvalidCheckpointState(f"{directory}: {what} is larger than {limit} bytes", directory=str(directory))
    return data


class DirectoryLock:
    """An advisory ``flock`` on a participant directory, held by every writer while it writes.

    A writer that gets it exclusively knows no live writer (in any process) uses the
    directory, so whatever temporary or unpublished file lies there was left by a dead one
    and may be removed; it then holds it shared for its own write. A filesystem without
    ``flock`` support just skips the clean-up (never a failure).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Lock the directory; True when this writer had it alone first (clean-up is safe)."""
        try:
            self._fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except OSError:
            alone = False
        return alone

    def share(self) -> None:
        """From exclusive (or none) to shared: other writers may now write beside this one."""
        if self._fd is None:
            return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
        except OSError:
            pass

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None


def remove_leftovers(directory: Path, manifest_name: str) -> list[str]:
    """Remove what a dead writer left (the caller holds the directory lock exclusively).

    Temporary files always; records files only while no manifest is published (with one
    published, they are left to ``verify``'s warning). Returns the names removed.
    """
    removed: list[str] = []
    published = os.path.lexists(directory / manifest_name)
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = LEFTOVER.fullmatch(name)
        if match is None or (published and not name.startswith(".")):
            continue
        path = directory / name
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue
    return removed
