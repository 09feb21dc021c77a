"""One write's incremental plan: which versioned records it refers to instead of writing them.

``CheckpointWriter`` and ``ObjectStoreWriter`` hold one ``Increment`` per write. Before the write,
it knows the participant's previous published checkpoint (``segments.Previous``) and which of its
records files the new checkpoint may use (a sibling directory, files still mostly used, at most
``MAX_SEGMENTS``). For each ``Versioned`` record the writer asks ``refer``: same owner, episode and
version as a record of a usable file, and the line is referred to (never built, never encoded);
else the record is written and ``wrote`` notes where. After the write, ``manifest`` turns the
full manifest into an incremental one when anything was referred to (else it stays full,
``schema_version`` 1), ``missing`` names referred files that are gone (checked just before the
manifest is published) and ``previous`` is what the next write of the participant starts from.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._errors import InvalidCheckpointState
from .._types import Versioned
from .layout import MANIFEST_FIELDS
from .location import Location, lexists
from .reader import capture_key_of
from .segments import INCREMENTAL_SCHEMA_VERSION, Previous, Segment, line_ranges, segment_directory

__all__ = ["Increment", "build_versioned", "versioned_slot"]

_OWN = -1


class Increment:
    def __init__(self, previous: Previous | None, checkpoint_dir: Location) -> None:
        self.checkpoint_dir = checkpoint_dir
        self._previous = previous
        self._usable = previous.reusable(checkpoint_dir) if previous is not None else frozenset()
        self._table: dict[tuple[str | None, str], tuple[Any, int, int]] = {}
        self._refs: dict[int, list[int]] = {}
        self.referred = 0

    def seen(self, slot: tuple[str | None, str]) -> bool:
        return slot in self._table

    def refer(self, slot: tuple[str | None, str], version: Any) -> bool:
        """True when ``slot``'s record at ``version`` is one the new checkpoint refers to (then noted)."""
        if not self._usable:
            return False
        assert self._previous is not None
        hit = self._previous.table.get(slot)
        if hit is None or hit[1] not in self._usable or hit[0] != version:
            return False
        self._table[slot] = hit
        self._refs.setdefault(hit[1], []).append(hit[2])
        self.referred += 1
        return True

    def wrote(self, slot: tuple[str | None, str], version: Any, line: int) -> None:
        self._table[slot] = (version, _OWN, line)

    def _used(self) -> list[int]:
        assert self._previous is not None or not self._refs
        return sorted(self._refs)

    def manifest(self, full: dict[str, Any]) -> dict[str, Any]:
        """``full`` when nothing was referred to; else the incremental manifest (extras kept last)."""
        if not self._refs:
            return full
        assert self._previous is not None
        segments = []
        for index in self._used():
            segment = self._previous.segments[index]
            segments.append(segment.entry(line_ranges(sorted(self._refs[index]))))
        manifest = {name: full[name] for name in MANIFEST_FIELDS}
        manifest["schema_version"] = INCREMENTAL_SCHEMA_VERSION
        manifest["depends_on"] = sorted({segment["checkpoint"] for segment in segments})
        manifest["segments"] = segments
        for key, value in full.items():
            if key not in manifest:
                manifest[key] = value
        return manifest

    def missing(self, directory: Location) -> list[str]:
        """Referred files that are not there any more (``directory``: this checkpoint's participant directory)."""
        if not self._refs:
            return []
        assert self._previous is not None
        gone = []
        for index in self._used():
            segment = self._previous.segments[index]
            where = segment_directory(directory, segment.checkpoint) / segment.records_file
            if not lexists(where):
                gone.append(f"{segment.checkpoint}/{segment.records_file}")
        return gone

    def previous(self, manifest: dict[str, Any]) -> Previous | None:
        """Where each versioned record of the published ``manifest`` lives, for the next write."""
        own = Segment(
            self.checkpoint_dir.name,
            manifest["checkpoint_id"],
            manifest["records_file"],
            manifest["records_sha256"],
            manifest["record_count"],
        )
        segments = [own]
        remap = {_OWN: 0}
        if self._previous is not None:
            for index in self._used():
                remap[index] = len(segments)
                segments.append(self._previous.segments[index])
        live = [0] * len(segments)
        table = {}
        for slot, (version, index, line) in self._table.items():
            where = remap[index]
            table[slot] = (version, where, line)
            live[where] += 1
        if not table:
            return None
        return Previous(self.checkpoint_dir, segments, table, live)


def versioned_slot(item: Versioned, increment: Increment | None, participant: str) -> tuple[str | None, str]:
    """``(owner, capture key)`` of a ``Versioned``; refused when invalid or exported twice."""
    try:
        key = capture_key_of(item.episode_id)
    except ValueError as exc:
        raise InvalidCheckpointState(f"a versioned record of {participant} has no valid episode_id: {exc}") from None
    slot = (item.plugin, key)
    if increment is not None and increment.seen(slot):
        raise InvalidCheckpointState(f"episode {key} is exported twice by one owner", episode=key)
    return slot


def _key(record: Any) -> str:
    try:
        return capture_key_of(record["episode_id"])
    except Exception:
        return "<no valid episode_id>"


def build_versioned(item: Versioned, slot: tuple[str | None, str]) -> Any:
    """The record of a ``Versioned`` (built now when it is a function), tagged with its plugin."""
    record = item.record() if callable(item.record) else item.record
    if type(record) is not dict and not isinstance(record, Mapping):
        return record  # refused by the writer's check, naming the record
    if _key(record) != slot[1]:
        raise InvalidCheckpointState(
            f"the record of versioned episode {slot[1]} names episode {_key(record)}", episode=slot[1]
        )
    if item.plugin is None and "plugin" in record:
        raise InvalidCheckpointState(
            f"the record of versioned episode {slot[1]} sets 'plugin', which names third-party owners",
            episode=slot[1],
        )
    if item.plugin is not None and record.get("plugin") != item.plugin:
        if "plugin" in record:
            raise InvalidCheckpointState(
                f"plugin {item.plugin!r} built a record of episode {slot[1]} naming {record['plugin']!r}",
                episode=slot[1],
            )
        record = {**record, "plugin": item.plugin}
    return record
