"""Writing to an object store: exclusive creates (the commit points), uploads, removals, the store probe.

See ``objstore`` for what stands in for rename, hard link and directory fsync on a store. Every
failure is ``WriteFailed`` naming the object and the cause (without credentials).
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Iterable
from typing import Any

from .._errors import WriteFailed
from .objstore import ObjectPath, StoreUnsafe, cause_of, size, write_failed

__all__ = [
    "UPLOAD_PARALLEL",
    "UPLOAD_PART",
    "check_exclusive_create",
    "create_exclusive",
    "forget_probes",
    "put_records",
    "remove",
    "upload",
]

# Uploads of records larger than two parts are multipart, UPLOAD_PARALLEL parts of UPLOAD_PART bytes
# in flight at once: at most their product in memory, whatever the records' size.
UPLOAD_PART = 16 << 20
UPLOAD_PARALLEL = 4


def create_exclusive(path: ObjectPath, data: bytes) -> bool:
    """Create ``path`` holding ``data`` only if no object is there; False when one already is.

    The commit point of a manifest or a participants index. ``WriteFailed`` for any other
    failure (a store whose filesystem has no exclusive create included).
    """
    try:
        path.fs.pipe_file(path.native, data, mode="create")
    except FileExistsError:
        return False
    except TypeError as exc:  # a filesystem whose pipe_file takes no mode: no exclusive create at all
        raise _unsafe(path, f"its filesystem offers no exclusive create ({cause_of(exc)})") from None
    except Exception as exc:
        raise write_failed(exc, path) from None
    return True


def upload(local_path: str, path: ObjectPath) -> None:
    """Upload a local file to ``path`` (multipart, parts in parallel, for large ones); ``WriteFailed``."""
    fs = path.fs
    try:
        fs.put_file(local_path, path.native, **_upload_options(fs))
    except Exception as exc:
        raise write_failed(exc, path) from None


def put_records(directory: ObjectPath, lines: Iterable[bytes], spool_dir: str | None = None) -> tuple[str, int]:
    """Upload encoded lines as ``directory/records-<sha256>.jsonl``; returns ``(digest, count)``.

    Spooled to a local ``0600`` file while hashed (the name needs the digest, and an object store
    has no rename), then uploaded and its size checked; the spool is removed on every path.
    ``WriteFailed`` for any failure.
    """
    import hashlib
    import tempfile

    from .files import create_private
    from .files import write_failed as local_write_failed
    from .layout import records_name

    name = f".ng-checkpoint-spool-{os.getpid()}-{uuid.uuid4().hex}.jsonl"  # removed if left: remove_dead_spools
    spool = os.path.join(spool_dir or tempfile.gettempdir(), name)
    try:
        sha, count, written = hashlib.sha256(), 0, 0
        try:
            with create_private(spool, buffering=1 << 20) as out:
                for line in lines:
                    sha.update(line)
                    out.write(line)
                    count += 1
                    written += len(line)
        except OSError as exc:
            raise local_write_failed(exc, spool, "cannot spool the records before their upload") from None
        digest = sha.hexdigest()
        target = directory / records_name(digest)
        upload(spool, target)
        stored = size(target)
        if stored != written:
            raise WriteFailed(
                f"{target}: the store holds {stored} bytes after the upload of {written}",
                path=str(target),
                cause="upload not stored whole",
            )
        return digest, count
    finally:
        with contextlib.suppress(OSError):
            os.unlink(spool)


def _upload_options(fs: Any) -> dict[str, int]:
    """Part size and parallelism for filesystems whose upload takes them (s3fs does); none for others."""
    import inspect

    method = getattr(type(fs), "_put_file", None) or type(fs).put_file
    try:
        accepted = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return {}
    options = {"chunksize": UPLOAD_PART, "max_concurrency": UPLOAD_PARALLEL}
    return {name: value for name, value in options.items() if name in accepted}


def remove(path: ObjectPath, *, recursive: bool = False) -> None:
    try:
        path.fs.rm(path.native, recursive=recursive)
    except FileNotFoundError:
        return
    except Exception as exc:
        raise write_failed(exc, path, "cannot remove") from None


_probe_lock = threading.Lock()
_probed: dict[tuple[str, str], StoreUnsafe | None] = {}


def _unsafe(where: ObjectPath, why: str) -> StoreUnsafe:
    return StoreUnsafe(
        f"{where}: the store cannot hold a checkpoint: {why}; a second writer could replace a published "
        "manifest. Use a store that honours exclusive creates (S3 If-None-Match: *, GCS ifGenerationMatch=0) "
        "or a filesystem path",
        path=str(where),
        cause="no_exclusive_create",
    )


def check_exclusive_create(directory: ObjectPath) -> None:
    """Refuse (``StoreUnsafe``) a store that accepts a second exclusive create of one object.

    Probed once per process for each protocol and bucket: a probe object is created twice
    under ``directory`` (the second must be refused), then removed. A failure to write the
    probe at all is a ``WriteFailed`` (not remembered: the next commit probes again).
    """
    key = (directory.protocol, directory.bucket)
    with _probe_lock:
        if key in _probed:
            verdict = _probed[key]
            if verdict is not None:
                raise verdict
            return
    probe = directory / f".ng-checkpoint-probe-{uuid.uuid4().hex}"
    try:
        if not create_exclusive(probe, b"probe\n"):
            raise _unsafe(probe, "a probe object with a fresh random name already existed")
        second = create_exclusive(probe, b"second\n")
    except StoreUnsafe as exc:
        with _probe_lock:
            _probed[key] = exc
        raise
    finally:
        try:
            remove(probe)
        except WriteFailed:
            pass  # a leftover probe object is harmless (gc removes it with its checkpoint)
    verdict = _unsafe(directory, "it accepted a second exclusive create of one object") if second else None
    with _probe_lock:
        _probed[key] = verdict
    if verdict is not None:
        raise verdict


def forget_probes() -> None:
    with _probe_lock:
        _probed.clear()
