"""Read and verify one participant's checkpoint in a single streaming pass.

The manifest is checked first (JSON object, every field, schema version, safe
names, a records file inside the participant directory). The records file is
then read line by line: each line is hashed, counted, decoded and validated,
and only records in scope are kept. The digest and the count are compared at
the end, before anything is returned, so a caller never sees records from a
file that does not verify. The whole file is never held in memory, nor one line
longer than the record bound. Only regular files are read (never a FIFO, a directory
or a link), without blocking, and every file opened is closed on every path. A capture
key that appears twice is refused: a restore never picks one copy silently.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from .._errors import InvalidCheckpointState
from .._identity import capture_key
from .codec import decode_line
from .files import open_regular
from .layout import (
    DEFAULT_MAX_RECORD_BYTES,
    MANIFEST_FIELDS,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    RECORDS_FILE,
    SAFE_COMPONENT,
    SCHEMA_VERSION,
    participant_dir,
)
from .location import Location, lexists, open_stream, read_small
from .objstore import ObjectPath
from .pipeline import hashed_lines
from .segments import INCREMENTAL_FIELDS, INCREMENTAL_SCHEMA_VERSION, check_segments, segment_directory, selected

__all__ = ["RestoredCheckpoint", "capture_key_of", "load_manifest", "read_checkpoint", "iter_verified_lines"]

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_RESERVED_SUFFIX = re.compile(r"-a[1-9][0-9]*$")
_EPISODE_KEYS = frozenset({"rollout_id", "attempt"})


@dataclass
class RestoredCheckpoint:
    manifest: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    total: int = 0


def capture_key_of(episode_id: Any) -> str:
    """Validate a record's ``{"rollout_id", "attempt"}`` and return its capture key.

    A plain check (not Gym's pydantic model) because it runs once per record on restore.
    """
    if type(episode_id) is dict:
        keys_ok = len(episode_id) == 2 and "rollout_id" in episode_id and "attempt" in episode_id
    else:
        keys_ok = isinstance(episode_id, Mapping) and set(episode_id) == _EPISODE_KEYS
    if not keys_ok:
        raise ValueError("episode_id must be an object with exactly rollout_id and attempt")
    rollout_id, attempt = episode_id["rollout_id"], episode_id["attempt"]
    if (
        not isinstance(rollout_id, str)
        or not SAFE_COMPONENT.fullmatch(rollout_id)
        or ("-a" in rollout_id and _RESERVED_SUFFIX.search(rollout_id))
    ):
        raise ValueError(f"rollout_id {rollout_id!r} is not a valid rollout id")
    if type(attempt) is not int or attempt < 0:
        raise ValueError(f"attempt {attempt!r} is not a non-negative integer")
    return capture_key(rollout_id, attempt)


def _bad(directory: Location, why: str, **data: Any) -> InvalidCheckpointState:
    return InvalidCheckpointState(f"{directory}: {why}", directory=str(directory), **data)


def load_manifest(directory: Location, *, kind: str | None = None, instance: str | None = None) -> dict[str, Any]:
    """Read and check ``manifest.json`` of a participant directory (a path, or an object-store prefix)."""
    path = directory / MANIFEST_NAME
    if not lexists(path):
        raise _bad(directory, "no manifest.json: the checkpoint was never published (incomplete write?)")
    raw = read_small(path, directory, MANIFEST_NAME, MAX_MANIFEST_BYTES)
    try:
        manifest = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise _bad(directory, "manifest.json is not JSON") from None
    if not isinstance(manifest, dict):
        raise _bad(directory, f"manifest.json is not a JSON object (got {type(manifest).__name__})")
    missing = [name for name in MANIFEST_FIELDS if name not in manifest]
    if missing:
        raise _bad(directory, f"manifest.json is missing {', '.join(missing)}")
    version = manifest["schema_version"]
    if type(version) is not int or version not in (SCHEMA_VERSION, INCREMENTAL_SCHEMA_VERSION):
        raise _bad(
            directory,
            f"manifest schema_version {version!r} is not one this reader knows "
            f"({SCHEMA_VERSION}: full, {INCREMENTAL_SCHEMA_VERSION}: incremental); written by a newer release?",
        )
    if version == INCREMENTAL_SCHEMA_VERSION:
        missing = [name for name in INCREMENTAL_FIELDS if name not in manifest]
        if missing:
            raise _bad(
                directory, f"manifest.json of schema_version {version} (incremental) is missing {', '.join(missing)}"
            )
    for name in ("kind", "instance", "checkpoint_id"):
        if not isinstance(manifest[name], str) or not SAFE_COMPONENT.fullmatch(manifest[name]):
            raise _bad(directory, f"manifest {name} {manifest[name]!r} is not a safe name")
    if kind is not None and manifest["kind"] != kind:
        raise _bad(directory, f"manifest kind {manifest['kind']!r} does not match the directory's {kind!r}")
    if instance is not None and manifest["instance"] != instance:
        raise _bad(directory, f"manifest instance {manifest['instance']!r} does not match {instance!r}")
    if not isinstance(manifest["records_file"], str) or not RECORDS_FILE.fullmatch(manifest["records_file"]):
        raise _bad(directory, f"records_file {manifest['records_file']!r} is not a records file name in this directory")
    if not isinstance(manifest["records_sha256"], str) or not _SHA256_HEX.fullmatch(manifest["records_sha256"]):
        raise _bad(directory, "records_sha256 is not a sha256 hex digest")
    count = manifest["record_count"]
    if type(count) is not int or count < 0:
        raise _bad(directory, f"record_count {count!r} is not a non-negative integer")
    if version == INCREMENTAL_SCHEMA_VERSION:
        check_segments(directory, manifest)
    return manifest


def _open_records(directory: Location, name: str) -> BinaryIO:
    """Open the records file, refusing one that resolves outside the participant directory."""
    if isinstance(directory, ObjectPath):
        # The name matched RECORDS_FILE (no separator): the object lies under the participant's prefix.
        return open_stream(directory / name, f"records file {name}")  # type: ignore[return-value]
    path = directory / name
    real_dir = os.path.realpath(directory)
    real = os.path.realpath(path)
    if os.path.dirname(real) != real_dir:
        raise _bad(directory, f"records file {name} resolves outside the participant directory")
    fd = open_regular(Path(real), directory, f"records file {name}")
    try:
        # Unbuffered: the reading worker asks for ~1 MiB at a time, read straight into its bytes.
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def iter_verified_lines(
    directory: Location, manifest: Mapping[str, Any], *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
) -> Iterator[bytes]:
    """Yield each record line of the checkpoint (without its newline): its own records file's, then
    the lines it uses of each earlier file an incremental manifest names; each file's count and
    digest are checked after its last line.

    Raises ``InvalidCheckpointState`` for a line longer than ``max_record_bytes`` (refused
    after reading at most that many of its bytes), a truncated last line, a count or a
    digest that does not match, a segment that is missing or does not verify (named with its
    checkpoint). A consumer must exhaust the iterator before trusting what it read.
    """
    for batch in _verified_batches(
        directory, manifest["records_file"], manifest["records_sha256"], manifest["record_count"], max_record_bytes
    ):
        yield from batch
    for segment in manifest.get("segments", ()) if manifest["schema_version"] == INCREMENTAL_SCHEMA_VERSION else ():
        where = segment_directory(directory, segment["checkpoint"])
        batches = _verified_batches(
            where,
            segment["records_file"],
            segment["records_sha256"],
            segment["record_count"],
            max_record_bytes,
            referenced_by=directory,
        )
        yield from selected(batches, segment["lines"])


def _verified_batches(
    directory: Location,
    name: str,
    digest: str,
    count: int,
    max_record_bytes: int,
    referenced_by: Location | None = None,
) -> Iterator[list[bytes]]:
    """The lines of one records file in batches, read and hashed by a worker; checked after the last."""
    # The checkpoint's own file as before; a segment named with the checkpoint that refers to it.
    what = "records file"
    if referenced_by is not None:
        what = f"records file {name} (a segment checkpoint {referenced_by.parent.parent.parent.name} refers to)"
    try:
        handle = _open_records(directory, name)
    except InvalidCheckpointState as exc:
        if referenced_by is None:
            raise
        raise _bad(directory, f"{what}: {exc.detail.removeprefix(f'{directory}: ')}") from None
    with handle:
        # A worker thread reads and hashes while this thread decodes what it already read.
        for item in hashed_lines(handle, max_record_bytes):
            if isinstance(item, list):
                yield item
                continue
            if item.error is not None:
                raise _bad(directory, f"{what} cannot be read: {item.error}") from item.error
            if item.too_long:
                of = "" if referenced_by is None else f" of {what}"
                raise _bad(
                    directory,
                    f"record {item.count}{of} is longer than max_record_bytes ({max_record_bytes} "
                    "bytes); refused without reading it whole",
                    record=item.count,
                )
            if item.truncated:
                raise _bad(directory, f"{what} ends in a truncated line (after {item.count} records)")
            if item.count != count:
                raise _bad(directory, f"{what} holds {item.count} records, manifest says {count}")
            if item.digest != digest:
                raise _bad(directory, f"{what} digest does not match the manifest (corrupted or replaced)")


def read_checkpoint(
    checkpoint_dir: str | Path | Location,
    kind: str,
    instance: str,
    *,
    scope: Collection[str] | None = None,
    validate: Callable[[dict[str, Any]], None] | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> RestoredCheckpoint:
    """Read, verify and validate one participant's checkpoint, keeping the records in ``scope``.

    ``scope`` is a collection of capture keys (``None``: every record). ``validate`` is
    called on each kept record and may raise ``ValueError`` to refuse it; the refusal is
    reported as ``invalid_checkpoint_state`` naming the episode. A capture key found twice
    for the same owner (the record's ``"plugin"``, absent for the participant's own records)
    in the file, in scope or not, is ``invalid_checkpoint_state`` naming the key.
    """
    directory = participant_dir(checkpoint_dir, kind, instance)
    manifest = load_manifest(directory, kind=kind, instance=instance)
    wanted = None if scope is None else frozenset(scope)
    result = RestoredCheckpoint(manifest=manifest)
    seen: set[tuple[Any, str]] = set()
    for line in iter_verified_lines(directory, manifest, max_record_bytes=max_record_bytes):
        number = result.total
        result.total += 1
        try:
            record = decode_line(line)
        except ValueError:
            raise _bad(directory, f"record {number} is not JSON") from None
        if not isinstance(record, dict):
            raise _bad(directory, f"record {number} is not a JSON object")
        try:
            key = capture_key_of(record.get("episode_id"))
        except ValueError as exc:
            raise _bad(directory, f"record {number} has no valid episode_id: {exc}") from None
        # Each plugin owns its records: one episode may have one record per owner, never two.
        owner_name = record.get("plugin")
        if owner_name is not None and (not isinstance(owner_name, str) or not owner_name):
            raise _bad(directory, f"record {number} ({key}) names no valid owning plugin", episode=key)
        owned = (owner_name, key)
        if owned in seen:
            owner = "" if owned[0] is None else f" of plugin {owned[0]!r}"
            raise _bad(
                directory, f"record {number} repeats episode {key}{owner}: a capture key appears twice", episode=key
            )
        seen.add(owned)
        if wanted is not None and key not in wanted:
            continue
        if validate is not None:
            try:
                validate(record)
            except ValueError as exc:
                raise _bad(directory, f"record of episode {key} fails validation: {exc}", episode=key) from None
        result.records.append(record)
    return result
