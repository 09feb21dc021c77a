"""Incremental checkpoints: a manifest that refers to records of earlier checkpoints by digest.

A records file is content-addressed (``records-<sha256>.jsonl``), so a later checkpoint may use
the lines of an earlier one's file instead of writing them again. Its manifest (``schema_version``
2, docs/protocol.md "Incremental checkpoints") keeps every field of a full one (its own records
file holds the records written this time, possibly none) and adds:

- ``segments``: the earlier records files it uses, each ``{"checkpoint", "checkpoint_id",
  "records_file", "records_sha256", "record_count", "lines"}``: ``checkpoint`` is the directory
  (a sibling of this checkpoint's directory, same parent) whose participant directory holds the
  file, ``record_count`` the file's line count and ``lines`` the ``[start, stop)`` ranges of its
  lines that belong to this checkpoint (sorted, disjoint, non-empty);
- ``depends_on``: the sorted names of those checkpoints.

Segments are flat: a file is always named in the checkpoint that wrote it, never through another
manifest, so a reader opens each file once and retention protects files, not chains. A reader
verifies each segment's digest and count as it verifies the checkpoint's own file, and streams
it: at most one batch of lines in memory, whatever the checkpoint's size. A checkpoint that
refers to nothing is written as a full one (``schema_version`` 1, byte for byte as before).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._errors import InvalidCheckpointState
from .layout import INCREMENTAL_FIELDS, RECORDS_FILE, SAFE_COMPONENT
from .location import Location

__all__ = [
    "INCREMENTAL_FIELDS",
    "INCREMENTAL_SCHEMA_VERSION",
    "MAX_SEGMENTS",
    "MIN_LIVE",
    "History",
    "Previous",
    "Segment",
    "check_segments",
    "line_ranges",
    "segment_directory",
    "selected",
]

INCREMENTAL_SCHEMA_VERSION = 2
# At most this many records files per checkpoint (its own included): past it, the next one is full,
# so a restore opens a bounded number of files whatever the number of checkpoints before it.
MAX_SEGMENTS = 8
# An earlier file is referred to only while at least this share of its lines are still used; below,
# its records are written again (a restore never reads a file mostly for lines it skips).
MIN_LIVE = 0.5
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_SEGMENT_FIELDS = frozenset({"checkpoint", "checkpoint_id", "records_file", "records_sha256", "record_count", "lines"})


@dataclass(frozen=True)
class Segment:
    """One records file of a checkpoint, as a manifest names it."""

    checkpoint: str
    checkpoint_id: str
    records_file: str
    records_sha256: str
    record_count: int

    def entry(self, lines: list[list[int]]) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "checkpoint_id": self.checkpoint_id,
            "records_file": self.records_file,
            "records_sha256": self.records_sha256,
            "record_count": self.record_count,
            "lines": lines,
        }


def segment_directory(directory: Location, checkpoint: str) -> Location:
    """The participant directory of sibling checkpoint ``checkpoint`` (``directory`` is this checkpoint's)."""
    # directory = <root>/<checkpoint>/gym/<kind>/<instance>
    instance, kind = directory.name, directory.parent.name
    root = directory.parent.parent.parent.parent
    return root / checkpoint / "gym" / kind / instance


def _bad(directory: Location, why: str) -> InvalidCheckpointState:
    return InvalidCheckpointState(f"{directory}: {why}", directory=str(directory))


def check_segments(directory: Location, manifest: Mapping[str, Any]) -> None:
    """Refuse an incremental manifest whose ``segments`` or ``depends_on`` are malformed."""
    segments, depends = manifest["segments"], manifest["depends_on"]
    if not isinstance(segments, list) or not segments:
        raise _bad(directory, "manifest segments is not a non-empty list")
    own = directory.parent.parent.parent.name
    names = set()
    for number, segment in enumerate(segments):
        what = f"manifest segment {number}"
        if not isinstance(segment, dict) or set(segment) != _SEGMENT_FIELDS:
            raise _bad(directory, f"{what} is not an object of {', '.join(sorted(_SEGMENT_FIELDS))}")
        for name in ("checkpoint", "checkpoint_id"):
            if not isinstance(segment[name], str) or not SAFE_COMPONENT.fullmatch(segment[name]):
                raise _bad(directory, f"{what}: {name} {segment[name]!r} is not a safe name")
        if segment["checkpoint"] == own:
            raise _bad(directory, f"{what} names this checkpoint's own directory")
        if not isinstance(segment["records_file"], str) or not RECORDS_FILE.fullmatch(segment["records_file"]):
            raise _bad(directory, f"{what}: records_file {segment['records_file']!r} is not a records file name")
        if not isinstance(segment["records_sha256"], str) or not _SHA256_HEX.fullmatch(segment["records_sha256"]):
            raise _bad(directory, f"{what}: records_sha256 is not a sha256 hex digest")
        count = segment["record_count"]
        if type(count) is not int or count < 1:
            raise _bad(directory, f"{what}: record_count {count!r} is not a positive integer")
        _check_ranges(directory, what, segment["lines"], count)
        key = (segment["checkpoint"], segment["records_file"])
        if key in names:
            raise _bad(directory, f"{what} repeats {segment['checkpoint']}/{segment['records_file']}")
        names.add(key)
    if depends != sorted({checkpoint for checkpoint, _ in names}):
        raise _bad(directory, "manifest depends_on is not the sorted checkpoints its segments name")


def _check_ranges(directory: Location, what: str, lines: Any, count: int) -> None:
    if not isinstance(lines, list) or not lines:
        raise _bad(directory, f"{what}: lines is not a non-empty list of [start, stop) ranges")
    after = 0
    for pair in lines:
        if (
            not isinstance(pair, list)
            or len(pair) != 2
            or type(pair[0]) is not int
            or type(pair[1]) is not int
            or not after <= pair[0] < pair[1] <= count
        ):
            raise _bad(directory, f"{what}: lines {pair!r:.80} is not a sorted, disjoint range within its {count}")
        after = pair[1]


def line_ranges(numbers: list[int]) -> list[list[int]]:
    """Sorted line numbers (no repeats) as ``[start, stop)`` ranges."""
    ranges: list[list[int]] = []
    for number in numbers:
        if ranges and ranges[-1][1] == number:
            ranges[-1][1] = number + 1
        else:
            ranges.append([number, number + 1])
    return ranges


def selected(batches: Iterator[list[bytes]], lines: list[list[int]]) -> Iterator[bytes]:
    """The lines of ``batches`` (a file's lines, in order) whose numbers fall in ``lines``' ranges."""
    ranges = iter(lines)
    start, stop = next(ranges)
    number = 0
    for batch in batches:
        end = number + len(batch)
        while start < end:
            low = max(start, number) - number
            high = min(stop, end) - number
            yield from batch[low:high]
            if stop > end:
                break
            nxt = next(ranges, None)
            if nxt is None:
                start = stop = end + (1 << 62)  # none left: the rest of the file is only verified
                break
            start, stop = nxt
        number = end


# -- the writer's memory of the previous checkpoint ----------------------------------------------------


@dataclass
class Previous:
    """Where a participant's previous published checkpoint keeps each versioned record.

    ``table`` maps ``(owner, capture key)`` to ``(version, segment index, line)``; ``live`` counts, per
    segment, the records of that checkpoint that live in it.
    """

    checkpoint_dir: Location
    segments: list[Segment]
    table: dict[tuple[str | None, str], tuple[Any, int, int]]
    live: list[int] = field(default_factory=list)

    def reusable(self, checkpoint_dir: Location) -> frozenset[int]:
        """The segments a checkpoint written into ``checkpoint_dir`` may refer to (none unless it is a sibling)."""
        if checkpoint_dir == self.checkpoint_dir or checkpoint_dir.parent != self.checkpoint_dir.parent:
            return frozenset()
        worth = [
            index
            for index, segment in enumerate(self.segments)
            if self.live[index] and self.live[index] >= MIN_LIVE * segment.record_count
        ]
        # The new checkpoint writes a file of its own: the most used earlier files fill the rest.
        worth.sort(key=lambda index: -self.live[index])
        return frozenset(worth[: MAX_SEGMENTS - 1])


class History:
    """The previous published checkpoint of each participant this process wrote (one per backend)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._previous: dict[tuple[str, str], Previous] = {}

    def get(self, kind: str, instance: str) -> Previous | None:
        with self._lock:
            return self._previous.get((kind, instance))

    def set(self, kind: str, instance: str, previous: Previous | None) -> None:
        with self._lock:
            if previous is None:
                self._previous.pop((kind, instance), None)
            else:
                self._previous[(kind, instance)] = previous
