"""Checkpoints in an object store: ``checkpoint_dir`` as an fsspec URL (docs/protocol.md, "Object stores").

An ``ObjectPath`` is a place in an fsspec filesystem spelled as a URL (``s3://bucket/run``,
``gs://...``, ``file:///...``, ``memory://...``); ``/`` joins like ``pathlib.Path``, so the
layout code builds ``<checkpoint_dir>/gym/<kind>/<instance>/manifest.json`` the same way for
both. The functions below are the few operations the format needs, each with the storage's
typed errors: a read that fails is ``InvalidCheckpointState`` naming the object, a write that
fails is ``WriteFailed`` naming the cause (the export is kept and may be retried).

What an object store lacks, and what stands in for it:

- no rename: the records object is written under its digest name (content-addressed, so a
  second PUT of the same name writes the same bytes), and verified on every read;
- no hard link: the manifest and the participants index are created exclusively (S3
  ``If-None-Match: *``, GCS ``ifGenerationMatch=0``: fsspec's ``pipe_file(mode="create")``),
  which is the commit point: of two writers exactly one creates it;
- no directory fsync: an acknowledged PUT is durable.

Stores differ in what they honour, so ``check_exclusive_create`` probes a store once per
process (per protocol and bucket) before the first commit into it, and a store that accepts
a second exclusive create of one object is refused (``StoreUnsafe``): there, two writers
could both publish.

Credentials come only from each filesystem's own environment and configuration (for S3:
``AWS_*`` variables, ``~/.aws``, instance roles; for any protocol, fsspec's configuration:
``FSSPEC_<PROTOCOL>_<KEY>`` variables and ``~/.config/fsspec``), never from the Gym YAML. A
URL carrying credentials (``s3://key:secret@bucket``) is refused without being repeated, and
every message this module builds is scrubbed of the credential values the environment holds.
fsspec is imported on first use, so a deployment writing local paths never loads it.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import uuid
from collections.abc import Iterable
from typing import IO, Any

from .._errors import InvalidCheckpointState, WriteFailed

__all__ = [
    "ObjectPath",
    "StoreUnsafe",
    "check_exclusive_create",
    "create_exclusive",
    "filesystem",
    "is_url",
    "normalize_url",
    "put_records",
    "scrub",
]

# ``scheme://rest``: a scheme as RFC 3986 spells one, at least two letters so that a Windows
# drive (``C://``) is never taken for one.
_URL = re.compile(r"^(?P<protocol>[A-Za-z][A-Za-z0-9+.-]+)://(?P<rest>.*)$", re.DOTALL)
_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f?#]")
# Environment variables whose values are secrets some filesystem reads; scrubbed from messages.
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "GOOGLE_API_KEY",
               "AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN",
               "AZURE_STORAGE_CONNECTION_STRING")


class StoreUnsafe(WriteFailed):
    """The store accepted a second exclusive create of one object: it cannot hold a commit point.

    ``invalid_checkpoint_state`` like every failed write (the export is kept: a retry into
    another store may succeed); ``data["cause"]`` is ``no_exclusive_create``.
    """


def is_url(value: object) -> bool:
    """Whether ``value`` is a string spelling an fsspec URL (``protocol://...``)."""
    return isinstance(value, str) and _URL.match(value) is not None


def normalize_url(url: str) -> str:
    """The URL with repeated and trailing slashes removed; ``ValueError`` (never repeating a
    credential) for one that cannot name a checkpoint directory."""
    match = _URL.match(url)
    if match is None:
        raise ValueError("not a URL (protocol://...)")
    protocol, rest = match["protocol"].lower(), match["rest"]
    authority = rest.split("/", 1)[0]
    if "@" in authority:
        # Never repeated: it is most likely a key and a secret.
        raise ValueError("a checkpoint_dir URL must not carry credentials (user:secret@...); they come from the "
                         "filesystem's own environment and configuration (for S3: AWS_* variables, ~/.aws)")
    if _FORBIDDEN.search(rest):
        raise ValueError("a checkpoint_dir URL must not contain a query (?), a fragment (#) or control characters")
    leading = "/" if rest.startswith("/") else ""
    parts = [part for part in rest.split("/") if part]
    if not parts:
        raise ValueError(f"the {protocol}:// URL names no bucket or directory")
    if any(part in (".", "..") for part in parts):
        raise ValueError("a checkpoint_dir URL must not contain . or .. components")
    return f"{protocol}://{leading}{'/'.join(parts)}"


class ObjectPath:
    """A place in an fsspec filesystem, spelled as a normalized URL; immutable, joins with ``/``."""

    __slots__ = ("url",)

    def __init__(self, url: str) -> None:
        object.__setattr__(self, "url", normalize_url(url))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ObjectPath is immutable")

    @property
    def protocol(self) -> str:
        return self.url.split("://", 1)[0]

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectPath:
        head, _, rest = self.url.partition("://")
        if "/" not in rest.strip("/"):
            return self
        return ObjectPath(f"{head}://{rest.rsplit('/', 1)[0]}")

    @property
    def bucket(self) -> str:
        """The first component (an S3 or GCS bucket): the unit a probe of the store covers."""
        return self.url.split("://", 1)[1].lstrip("/").split("/", 1)[0]

    @property
    def fs(self) -> Any:
        return filesystem(self.protocol)

    @property
    def native(self) -> str:
        """The path as the filesystem spells it (``bucket/key`` for S3)."""
        return type(self.fs)._strip_protocol(self.url)

    def __truediv__(self, name: str) -> ObjectPath:
        if not isinstance(name, str) or not name or "/" in name.strip("/"):
            raise ValueError(f"cannot join {name!r} to an object path: one component at a time")
        return ObjectPath(f"{self.url}/{name.strip('/')}")

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ObjectPath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(("ObjectPath", self.url))

    def __lt__(self, other: ObjectPath) -> bool:
        return self.url < other.url


_fs_lock = threading.Lock()
_filesystems: dict[str, Any] = {}


def filesystem(protocol: str) -> Any:
    """The process's fsspec filesystem for ``protocol``, configured only by the filesystem's own
    environment and fsspec's configuration. Listings are never cached: other processes write
    the same store, and a stale listing would hide their checkpoints (or show removed ones)."""
    with _fs_lock:
        fs = _filesystems.get(protocol)
        if fs is None:
            try:
                import fsspec

                options: dict[str, Any] = {"use_listings_cache": False}
                if protocol in ("file", "local"):
                    options["auto_mkdir"] = True  # as an object store: a key needs no parent made first
                fs = fsspec.filesystem(protocol, **options)
            except (ImportError, ValueError) as exc:
                # fsspec's message names the package to install (s3fs, gcsfs...).
                raise WriteFailed(f"{protocol}:// is not available: {scrub(str(exc))}", cause="no_filesystem",
                                  path=f"{protocol}://") from None
            _filesystems[protocol] = fs
        return fs


def reset_filesystems() -> None:
    """Forget the filesystems made so far (tests that change the environment between stores)."""
    with _fs_lock:
        _filesystems.clear()
    with _probe_lock:
        _probed.clear()


def scrub(text: str) -> str:
    """``text`` with every credential value the environment holds replaced by ``***``."""
    for name in _SECRET_ENV:
        value = os.environ.get(name, "")
        if len(value) >= 4 and value in text:
            text = text.replace(value, "***")
    return text


def cause_of(exc: BaseException) -> str:
    """A failure of the store in words, without credentials."""
    from .files import cause_in_words

    if isinstance(exc, OSError) and exc.errno is not None:
        return cause_in_words(exc)
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return scrub(f"{type(exc).__name__}: {message}" if message else type(exc).__name__)


def write_failed(exc: BaseException, where: ObjectPath, what: str = "cannot store the checkpoint") -> WriteFailed:
    cause = cause_of(exc)
    return WriteFailed(f"{where}: {what}: {cause}", path=str(where), cause=cause)


def read_failed(where: ObjectPath, what: str, exc: BaseException) -> InvalidCheckpointState:
    directory = where.parent
    if isinstance(exc, FileNotFoundError):
        return InvalidCheckpointState(f"{directory}: {what} is missing", directory=str(directory))
    return InvalidCheckpointState(f"{directory}: {what} cannot be read: {cause_of(exc)}", directory=str(directory))


# -- reading -------------------------------------------------------------------------------------

def exists(path: ObjectPath) -> bool:
    """Whether an object (or a prefix holding some) is there; a store that cannot say is a read failure."""
    try:
        return bool(path.fs.exists(path.native))
    except Exception as exc:
        raise read_failed(path, path.name, exc) from None


def read_small(path: ObjectPath, what: str, limit: int) -> bytes:
    """The whole of a small object (a manifest, an index), refusing one longer than ``limit`` bytes."""
    try:
        # One ranged GET: never more than limit + 1 bytes, however large the object.
        data = path.fs.cat_file(path.native, start=0, end=limit + 1)
    except Exception as exc:
        raise read_failed(path, what, exc) from None
    if len(data) > limit:
        raise InvalidCheckpointState(f"{path.parent}: {what} is larger than {limit} bytes",
                                     directory=str(path.parent))
    return bytes(data)


# Records are read in blocks of this size, the next one fetched while the current one is consumed:
# a restore holds two blocks of the object at most, whatever its size.
READ_BLOCK = 8 << 20
# Uploads of records larger than two parts are multipart, UPLOAD_PARALLEL parts of UPLOAD_PART bytes
# in flight at once: at most their product in memory, whatever the records' size.
UPLOAD_PART = 16 << 20
UPLOAD_PARALLEL = 4


def open_stream(path: ObjectPath, what: str) -> IO[bytes]:
    """A binary stream over an object (records), fetched block by block, never held whole."""
    try:
        # Two blocks cached, not fsspec's default 32: the cache never grows with the object.
        return path.fs.open(path.native, "rb", block_size=READ_BLOCK, cache_type="background",
                            cache_options={"maxblocks": 2})
    except Exception as exc:
        raise read_failed(path, what, exc) from None


def size(path: ObjectPath) -> int | None:
    try:
        return int(path.fs.size(path.native))
    except Exception:
        return None


def entries(path: ObjectPath) -> list[tuple[str, bool]]:
    """``(name, is_directory)`` of what ``path`` holds, sorted; ``[]`` when there is nothing there."""
    try:
        listed = path.fs.ls(path.native, detail=True)
    except FileNotFoundError:
        return []
    except Exception as exc:
        raise read_failed(path / "listing", f"the listing of {path}", exc) from None
    base = path.native.rstrip("/")
    found = []
    for entry in listed:
        name = str(entry["name"]).rstrip("/")
        if name == base:
            continue  # some stores list a prefix's own placeholder
        found.append((name.rsplit("/", 1)[-1], entry.get("type") == "directory"))
    return sorted(found)


# -- writing -------------------------------------------------------------------------------------

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
            raise WriteFailed(f"{target}: the store holds {stored} bytes after the upload of {written}",
                              path=str(target), cause="upload not stored whole")
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
        "or a filesystem path", path=str(where), cause="no_exclusive_create",
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
