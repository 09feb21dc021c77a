"""Names and paths of the on-disk checkpoint layout (docs/protocol.md, "Storage layout").

``<checkpoint_dir>/gym/<kind>/<instance>/records-<sha256>.jsonl`` and
``<checkpoint_dir>/gym/<kind>/<instance>/manifest.json``, and the controller's
``<checkpoint_dir>/gym/participants.json``. ``checkpoint_dir`` is a filesystem path or an fsspec
URL (``location``); the names are the same in both.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, overload

from .._errors import InvalidCheckpointState
from .location import Location, location
from .objstore import ObjectPath

__all__ = [
    "SCHEMA_VERSION",
    "DEFAULT_MAX_RECORD_BYTES",
    "INDEX_NAME",
    "MAX_MANIFEST_BYTES",
    "MANIFEST_NAME",
    "MANIFEST_FIELDS",
    "SAFE_COMPONENT",
    "RECORDS_FILE",
    "records_name",
    "participant_dir",
    "check_component",
]

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
MANIFEST_FIELDS = (
    "schema_version",
    "kind",
    "instance",
    "checkpoint_id",
    "records_file",
    "records_sha256",
    "record_count",
)
# What an incremental manifest adds (``segments``): never a participant's extra.
INCREMENTAL_FIELDS = ("depends_on", "segments")
INDEX_NAME = "participants.json"
# A record's encoded size (its line, newline included) is bounded, so a reader never holds an
# endless line; ``checkpoint.storage.max_record_bytes`` changes it. 64 MiB holds an episode of
# hundreds of thousands of tokens with their logprobs.
DEFAULT_MAX_RECORD_BYTES = 64 << 20
# Manifests and the participants index are small; anything past this is not one.
MAX_MANIFEST_BYTES = 16 << 20
SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
RECORDS_FILE = re.compile(r"^records(-[0-9a-f]{64})?\.jsonl$")


def check_component(what: str, value: object) -> str:
    """A ``kind`` or ``instance`` must be one safe path component."""
    if not isinstance(value, str) or not SAFE_COMPONENT.fullmatch(value):
        raise InvalidCheckpointState(f"{what} {value!r} is not a safe path component ({SAFE_COMPONENT.pattern})")
    return value


def records_name(sha256_hex: str) -> str:
    return f"records-{sha256_hex}.jsonl"


@overload
def participant_dir(checkpoint_dir: Path, kind: str, instance: str) -> Path: ...
@overload
def participant_dir(checkpoint_dir: ObjectPath, kind: str, instance: str) -> ObjectPath: ...
@overload
def participant_dir(checkpoint_dir: str | Path | Location, kind: str, instance: str) -> Location: ...
def participant_dir(checkpoint_dir: str | Path | Location, kind: str, instance: str) -> Location:
    """``<checkpoint_dir>/gym/<kind>/<instance>``: a ``Path``, or an ``ObjectPath`` when ``checkpoint_dir`` is a URL."""
    return location(checkpoint_dir) / "gym" / check_component("kind", kind) / check_component("instance", instance)


def build_manifest(
    kind: str, instance: str, checkpoint_id: str, digest: str, count: int, extras: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The manifest of one participant's records (the protocol's fields, then ``extras`` under their own keys).

    ``InvalidCheckpointState`` when an extra would replace a protocol field.
    """
    manifest: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "instance": instance,
        "checkpoint_id": checkpoint_id,
        "records_file": records_name(digest),
        "records_sha256": digest,
        "record_count": count,
    }
    for key, value in (extras or {}).items():
        if key in manifest or key in INCREMENTAL_FIELDS:
            raise InvalidCheckpointState(f"manifest extra {key!r} would replace a protocol field")
        manifest[key] = value
    return manifest
