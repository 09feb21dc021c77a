"""Where a checkpoint lives: a filesystem path or an object-store URL, read the same way.

``location(value)`` turns what a caller holds (a ``Path``, a path string, a URL string, an
``ObjectPath``) into a ``Path`` or an ``ObjectPath``; both join with ``/``. The readers of
the format (manifests, the participants index, records) go through the few functions here,
which pick the careful POSIX access of ``files`` for a path and ``objstore`` for a URL.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Union, overload

from .objstore import ObjectPath, is_url, normalize_url

__all__ = [
    "Location",
    "child_dirs",
    "is_dir",
    "lexists",
    "location",
    "names",
    "normalize_checkpoint_dir",
    "read_small",
    "size",
]

Location = Union[Path, ObjectPath]  # noqa: UP007 - a runtime alias (isinstance checks), not only an annotation


@overload
def location(value: Path) -> Path: ...
@overload
def location(value: ObjectPath) -> ObjectPath: ...
@overload
def location(value: str | os.PathLike[str] | ObjectPath) -> Location: ...
def location(value: str | os.PathLike[str] | ObjectPath) -> Location:
    """A ``Path`` for a filesystem path, an ``ObjectPath`` for a URL (``s3://...``)."""
    if isinstance(value, ObjectPath | Path):
        return value
    if is_url(value):
        return ObjectPath(value)
    return Path(value)


def normalize_checkpoint_dir(value: str) -> str:
    """One spelling per directory, so a retried commit or restore is recognized as the same one:
    ``os.path.normpath`` of a path, repeated and trailing slashes removed from a URL."""
    return normalize_url(value) if is_url(value) else os.path.normpath(value)


def lexists(where: Location) -> bool:
    if isinstance(where, ObjectPath):
        from .objstore import exists

        return exists(where)
    return os.path.lexists(where)


def read_small(where: Location, directory: Location, what: str, limit: int) -> bytes:
    """The content of a small file or object (a manifest, an index), refused past ``limit`` bytes."""
    if isinstance(where, ObjectPath):
        from .objstore import read_small as read_object

        return read_object(where, what, limit)
    from .files import read_regular

    return read_regular(where, directory, what, limit)  # type: ignore[arg-type]


def open_stream(where: ObjectPath, what: str) -> IO[bytes]:
    from .objstore import open_stream as open_object

    return open_object(where, what)


def size(where: Location) -> int | None:
    if isinstance(where, ObjectPath):
        from .objstore import size as object_size

        return object_size(where)
    try:
        return where.stat().st_size
    except OSError:
        return None


def is_dir(where: Location) -> bool:
    """A directory, or on an object store a prefix holding at least one object."""
    if isinstance(where, ObjectPath):
        from .objstore import entries

        return bool(entries(where))
    return where.is_dir()


def child_dirs(where: Location) -> list[str]:
    """Names of the directories (prefixes) ``where`` holds, sorted."""
    if isinstance(where, ObjectPath):
        from .objstore import entries

        return [name for name, directory in entries(where) if directory]
    try:
        return sorted(p.name for p in where.iterdir() if p.is_dir())
    except FileNotFoundError:
        return []


def names(where: Location) -> list[str]:
    """Names of everything ``where`` holds (files and directories), sorted; ``[]`` when it cannot be listed."""
    if isinstance(where, ObjectPath):
        from .objstore import entries

        return [name for name, _directory in entries(where)]
    try:
        return sorted(os.listdir(where))
    except OSError:
        return []
