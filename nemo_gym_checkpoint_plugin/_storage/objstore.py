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

Stores differ in what they honour, so ``objstore_put.check_exclusive_create`` probes a store
once per process (per protocol and bucket) before the first commit into it, and a store that
accepts a second exclusive create of one object is refused (``StoreUnsafe``): there, two
writers could both publish. This module names places and reads them; ``objstore_put`` writes.

Credentials come only from each filesystem's own environment and configuration (for S3:
``AWS_*`` variables, ``~/.aws``, instance roles; for any protocol, fsspec's configuration:
``FSSPEC_<PROTOCOL>_<KEY>`` variables and ``~/.config/fsspec``), never from the Gym YAML. A
URL carrying credentials (``s3://key:secret@bucket``) is refused without being repeated, and
every message this module builds is scrubbed of the credential values the environment holds.
fsspec is imported on first use, so a deployment writing local paths never loads it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import threading
from typing import IO, Any, TypeGuard

from .._errors import InvalidCheckpointState, WriteFailed

__all__ = [
    "ObjectPath",
    "StoreUnsafe",
    "cause_of",
    "entries",
    "exists",
    "filesystem",
    "is_url",
    "normalize_url",
    "open_stream",
    "read_failed",
    "read_small",
    "reset_filesystems",
    "scrub",
    "size",
    "write_failed",
]

# ``scheme://rest``: a scheme as RFC 3986 spells one, at least two letters so that a Windows
# drive (``C://``) is never taken for one.
_URL = re.compile(r"^(?P<protocol>[A-Za-z][A-Za-z0-9+.-]+)://(?P<rest>.*)$", re.DOTALL)
_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f?#]")
# Environment variables whose values are secrets some filesystem reads; scrubbed from messages.
_SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "GOOGLE_API_KEY",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_CONNECTION_STRING",
)


class StoreUnsafe(WriteFailed):
    """The store accepted a second exclusive create of one object: it cannot hold a commit point.

    ``invalid_checkpoint_state`` like every failed write (the export is kept: a retry into
    another store may succeed); ``data["cause"]`` is ``no_exclusive_create``.
    """


def is_url(value: object) -> TypeGuard[str]:
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
        raise ValueError(
            "a checkpoint_dir URL must not carry credentials (user:secret@...); they come from the "
            "filesystem's own environment and configuration (for S3: AWS_* variables, ~/.aws)"
        )
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
    url: str

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
                raise WriteFailed(
                    f"{protocol}:// is not available: {scrub(str(exc))}", cause="no_filesystem", path=f"{protocol}://"
                ) from None
            _filesystems[protocol] = fs
        return fs


def reset_filesystems() -> None:
    """Forget the filesystems made so far, and which stores were probed (tests that change the environment)."""
    from .objstore_put import forget_probes

    with _fs_lock:
        _filesystems.clear()
    forget_probes()


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
        raise InvalidCheckpointState(f"{path.parent}: {what} is larger than {limit} bytes", directory=str(path.parent))
    return bytes(data)


# Other filesystems than S3 read records in blocks of this size, the next one fetched while the
# current one is consumed: a restore holds two blocks of the object at most, whatever its size.
READ_BLOCK = 8 << 20


class _S3Stream(io.RawIOBase):
    """One GET of a whole S3 object, its body read as it arrives (through s3fs's own client and loop).

    A single request per records object: ranged GETs of fixed blocks would each be a request (and
    some S3-compatible stores pay for the whole object on every ranged GET). The body is verified
    against its length at its end by botocore; the digest is the reader's to check.
    """

    def __init__(self, fs: Any, path: ObjectPath) -> None:
        from fsspec.asyn import sync

        self._fs, self._sync = fs, sync
        bucket, key, version = fs.split_path(path.native)
        extra = {"VersionId": version} if version else {}
        reply = sync(fs.loop, fs._call_s3, "get_object", Bucket=bucket, Key=key, **extra)
        self._body = reply["Body"]

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        chunk = self._sync(self._fs.loop, self._body.read, len(buffer))
        buffer[: len(chunk)] = chunk
        return len(chunk)

    def close(self) -> None:
        if not self.closed:
            with contextlib.suppress(Exception):
                self._body.close()
        super().close()


def open_stream(path: ObjectPath, what: str) -> IO[bytes]:
    """A binary stream over an object (records), read as it arrives, never held whole."""
    fs = path.fs
    if hasattr(fs, "_call_s3") and hasattr(fs, "split_path"):
        try:
            return io.BufferedReader(_S3Stream(fs, path), buffer_size=1 << 20)
        except Exception as exc:
            raise read_failed(path, what, exc) from None
    try:
        # Two blocks cached, not fsspec's default 32: the cache never grows with the object.
        return path.fs.open(
            path.native, "rb", block_size=READ_BLOCK, cache_type="background", cache_options={"maxblocks": 2}
        )
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
