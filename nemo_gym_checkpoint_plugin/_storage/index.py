"""The participants index: which participants a checkpoint must hold.

After every participant committed, the controller writes
``<checkpoint_dir>/gym/participants.json`` (created last, never replaced: a temporary
file, fsynced, hard-linked, like manifests)::

    {"schema_version": 1, "checkpoint_id": "step-120",
     "participants": [{"kind": "model", "instance": "policy_model", "records_sha256": "..."}, ...]}

On an object store (``checkpoint_dir`` an fsspec URL) the index is created exclusively instead
(``If-None-Match: *``), after the store was probed to refuse a second exclusive create.

``verify`` and a restore check the directory against it before reading anything else,
so a participant directory that went missing (or was replaced by another write) is
named instead of silently absent. A checkpoint without an index (another
implementation's) is read without that check; callers warn.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson

from .._errors import InvalidCheckpointState
from .files import create_private, make_private_dirs, write_failed
from .layout import INDEX_NAME, MAX_MANIFEST_BYTES, SAFE_COMPONENT, SCHEMA_VERSION, participant_dir
from .location import Location, lexists, location, read_small
from .objstore import ObjectPath
from .reader import load_manifest

__all__ = [
    "check_participants_index",
    "index_path",
    "index_problems",
    "read_participants_index",
    "write_participants_index",
]

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_ENTRY_FIELDS = frozenset({"kind", "instance", "records_sha256"})


def index_path(checkpoint_dir: str | Path | Location) -> Location:
    return location(checkpoint_dir) / "gym" / INDEX_NAME


def _entries(participants: Iterable[Mapping[str, Any]], where: Location) -> list[dict[str, str]]:
    entries: dict[tuple[str, str], dict[str, str]] = {}
    for entry in participants:
        if not isinstance(entry, Mapping) or set(entry) != _ENTRY_FIELDS:
            raise InvalidCheckpointState(f"{where}: a participant entry is not {{kind, instance, records_sha256}}")
        kind, instance, digest = entry["kind"], entry["instance"], entry["records_sha256"]
        for name, value in (("kind", kind), ("instance", instance)):
            if not isinstance(value, str) or not SAFE_COMPONENT.fullmatch(value):
                raise InvalidCheckpointState(f"{where}: participant {name} {value!r} is not a safe name")
        if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
            raise InvalidCheckpointState(f"{where}: records_sha256 of {kind}/{instance} is not a sha256 hex digest")
        if (kind, instance) in entries:
            raise InvalidCheckpointState(f"{where}: participant {kind}/{instance} is listed twice")
        entries[(kind, instance)] = {"kind": kind, "instance": instance, "records_sha256": digest}
    return [entries[key] for key in sorted(entries)]


def read_participants_index(checkpoint_dir: str | Path | Location) -> dict[str, Any] | None:
    """The checked index, or ``None`` when the checkpoint has none. Refuses a malformed one (and
    anything but a regular file there) with ``InvalidCheckpointState``."""
    path = index_path(checkpoint_dir)
    if not lexists(path):
        return None
    raw = read_small(path, path.parent, INDEX_NAME, MAX_MANIFEST_BYTES)
    try:
        index = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidCheckpointState(f"{path}: not JSON") from None
    if not isinstance(index, dict) or set(index) != {"schema_version", "checkpoint_id", "participants"}:
        raise InvalidCheckpointState(f"{path}: not an object of schema_version, checkpoint_id, participants")
    if type(index["schema_version"]) is not int or index["schema_version"] != SCHEMA_VERSION:
        raise InvalidCheckpointState(f"{path}: schema_version {index['schema_version']!r} is not {SCHEMA_VERSION}")
    if not isinstance(index["checkpoint_id"], str) or not SAFE_COMPONENT.fullmatch(index["checkpoint_id"]):
        raise InvalidCheckpointState(f"{path}: checkpoint_id {index['checkpoint_id']!r} is not a safe name")
    if not isinstance(index["participants"], list):
        raise InvalidCheckpointState(f"{path}: participants is not a list")
    index["participants"] = _entries(index["participants"], path)
    return index


def index_problems(checkpoint_dir: str | Path | Location, index: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """``(kind, instance, problem)`` for each participant the index lists that the directory lacks,
    whose manifest does not load, or whose manifest is of another checkpoint or records digest."""
    problems = []
    for entry in index["participants"]:
        kind, instance = entry["kind"], entry["instance"]
        directory = participant_dir(checkpoint_dir, kind, instance)
        if not lexists(directory):
            problems.append(
                (kind, instance, f"participant {kind}/{instance} is listed in {INDEX_NAME} but {directory} is missing")
            )
            continue
        try:
            manifest = load_manifest(directory, kind=kind, instance=instance)
        except InvalidCheckpointState as exc:
            problems.append(
                (kind, instance, f"participant {kind}/{instance} is listed in {INDEX_NAME} but {exc.detail}")
            )
            continue
        if manifest["checkpoint_id"] != index["checkpoint_id"]:
            problems.append(
                (
                    kind,
                    instance,
                    f"participant {kind}/{instance} holds checkpoint "
                    f"{manifest['checkpoint_id']!r}, {INDEX_NAME} lists "
                    f"{index['checkpoint_id']!r}",
                )
            )
        elif manifest["records_sha256"] != entry["records_sha256"]:
            problems.append(
                (
                    kind,
                    instance,
                    f"participant {kind}/{instance}: its manifest's records_sha256 "
                    f"differs from {INDEX_NAME}'s (another write replaced it)",
                )
            )
    return problems


def check_participants_index(checkpoint_dir: str | Path | Location) -> dict[str, Any] | None:
    """Check the directory against its index (see ``index_problems``); ``InvalidCheckpointState``
    naming every failing participant, the index when all are there, ``None`` without an index."""
    index = read_participants_index(checkpoint_dir)
    if index is None:
        return None
    problems = index_problems(checkpoint_dir, index)
    if problems:
        raise InvalidCheckpointState(
            f"{checkpoint_dir}: " + "; ".join(problem for _, _, problem in problems),
            participants=[f"{kind}/{instance}" for kind, instance, _ in problems],
        )
    return index


def write_participants_index(
    checkpoint_dir: str | Path | Location, checkpoint_id: str, participants: Iterable[Mapping[str, Any]]
) -> dict[str, Any]:
    """Create ``gym/participants.json`` (mode 0600, never replacing one); returns the index.

    ``participants`` are ``{"kind", "instance", "records_sha256"}`` mappings (each participant's
    committed manifest has them). Writing the same index again (a retried commit) returns it; an
    index that differs is refused. Filesystem failures are ``WriteFailed``.
    """
    path = index_path(checkpoint_dir)
    if not isinstance(checkpoint_id, str) or not SAFE_COMPONENT.fullmatch(checkpoint_id):
        raise InvalidCheckpointState(f"checkpoint id {checkpoint_id!r} is not valid")
    index = {
        "schema_version": SCHEMA_VERSION,
        "checkpoint_id": checkpoint_id,
        "participants": _entries(participants, path),
    }
    if isinstance(path, ObjectPath):
        return _create_object_index(path, index)
    tmp = path.parent / f".participants.{uuid.uuid4().hex}.tmp"
    try:
        make_private_dirs(path.parent, base=path.parent.parent)  # gym/ never reached through a symlink
        with create_private(tmp) as out:
            out.write(orjson.dumps(index) + b"\n")
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return _same_index(path, index)
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise write_failed(exc, path) from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
    return index


def _same_index(path: Location, index: dict[str, Any]) -> dict[str, Any]:
    """``index`` when the one already at ``path`` is the same (a retried commit); else refuse."""
    existing = read_participants_index(path.parent.parent)
    if existing != index:
        raise InvalidCheckpointState(
            f"{path} already lists another set of participants (checkpoint "
            f"{existing['checkpoint_id'] if existing else None!r}); refusing to replace it"
        )
    return index


def _create_object_index(path: ObjectPath, index: dict[str, Any]) -> dict[str, Any]:
    """The index on an object store: created exclusively (the commit point), never replaced."""
    from .objstore_put import check_exclusive_create, create_exclusive

    check_exclusive_create(path.parent.parent)
    if create_exclusive(path, orjson.dumps(index) + b"\n"):
        return index
    return _same_index(path, index)
