"""Retention and incremental checkpoints: records files a checkpoint that stays refers to are never removed.

An incremental checkpoint's manifests name records files of earlier checkpoints (``segments``). When
the retention rule removes such an earlier checkpoint, its publish markers go first (as for any
removal: it is no longer a checkpoint anyone restores), then every file but the records files a
checkpoint that stays refers to. What is left is a directory of records files only, unpublished;
every later run of the rule removes it the same way, down to the files still referred to, and
removes it whole once nothing refers to it.

References are read from the participant manifests of every checkpoint that stays (kept, in use,
in progress, or outside what the caller considers), so a write in progress whose manifest is
published already is covered; its base, the participant's previous published checkpoint, is the
newest published one as a rule, which the rule keeps. A manifest that cannot be read refers to
nothing (it is not a checkpoint a restore could use).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

import orjson

from .._errors import InvalidCheckpointState
from .layout import MANIFEST_NAME, MAX_MANIFEST_BYTES, RECORDS_FILE, SAFE_COMPONENT
from .location import Location, child_dirs, lexists, read_small
from .objstore import ObjectPath
from .segments import INCREMENTAL_SCHEMA_VERSION

__all__ = ["referred_files", "prune_to"]


def referred_files(checkpoints: Iterable[Location]) -> dict[str, set[str]]:
    """For each checkpoint name, the files (``gym/<kind>/<instance>/<records file>``) ``checkpoints`` refer to."""
    found: dict[str, set[str]] = {}
    for path in checkpoints:
        gym = path / "gym"
        try:
            kinds = child_dirs(gym)
        except (InvalidCheckpointState, OSError):
            continue
        for kind in kinds:
            for instance in child_dirs(gym / kind):
                for checkpoint, name in _segments(gym / kind / instance / MANIFEST_NAME):
                    found.setdefault(checkpoint, set()).add(f"gym/{kind}/{instance}/{name}")
    return found


def _segments(manifest: Location) -> list[tuple[str, str]]:
    try:
        if not lexists(manifest):
            return []
        data = orjson.loads(read_small(manifest, manifest.parent, MANIFEST_NAME, MAX_MANIFEST_BYTES))
    except (InvalidCheckpointState, orjson.JSONDecodeError, OSError):
        return []
    if not isinstance(data, dict) or data.get("schema_version") != INCREMENTAL_SCHEMA_VERSION:
        return []
    pairs = []
    for segment in data.get("segments") or ():
        if not isinstance(segment, dict):
            continue
        checkpoint, name = segment.get("checkpoint"), segment.get("records_file")
        if isinstance(checkpoint, str) and SAFE_COMPONENT.fullmatch(checkpoint):
            if isinstance(name, str) and RECORDS_FILE.fullmatch(name):
                pairs.append((checkpoint, name))
    return pairs


def prune_to(path: Location, keep: set[str]) -> None:
    """Remove everything under checkpoint ``path`` but the files ``keep`` names (relative paths)."""
    if isinstance(path, ObjectPath):
        try:
            listed = path.fs.find(path.native)
        except Exception:
            listed = []
        base = path.native.rstrip("/") + "/"
        for native in listed:
            relative = str(native)[len(base) :] if str(native).startswith(base) else None
            if relative is not None and relative not in keep:
                _remove_object(path, relative)
        return
    from .files import write_failed

    for directory, dirs, files in os.walk(path, topdown=False):
        for name in files:
            full = os.path.join(directory, name)
            if os.path.relpath(full, path) in keep:
                continue
            try:
                os.unlink(full)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise write_failed(exc, full, "cannot remove") from None
        for name in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(directory, name))  # only an empty one
    if not keep:
        with contextlib.suppress(OSError):
            os.rmdir(path)


def _remove_object(path: ObjectPath, relative: str) -> None:
    from .objstore_put import remove

    where = path
    for part in relative.split("/"):
        where = where / part
    remove(where)
