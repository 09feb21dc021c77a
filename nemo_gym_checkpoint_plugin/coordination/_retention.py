"""Which collection checkpoints may go: the one retention rule (``collect`` prunes with it).

``checkpoints_to_remove`` is a pure function over what a checkpoint directory holds, so every
caller (``ng-checkpoint collect`` after each publish and before each attempt writes; a garbage
collector of old checkpoints) applies the same rule:

- only this collection's checkpoints are ever removed: a **published** checkpoint is this
  collection's when its collector manifest names this collection (its output file); an
  **unpublished** one (no collector manifest: its id alone says whose it was) when its run is one
  of this collection's runs (this collector's, a predecessor it took the directory over from, or
  the run of any of its published checkpoints). Anything else in the directory is another run's
  and is left alone;
- of this collection's published checkpoints the ``keep`` newest stay; older ones go;
- an unpublished checkpoint of this collection is an attempt that failed (or was cut short by a
  crash): it goes, unless it is in use (the attempt being written now);
- a checkpoint in ``in_use`` (being written, or read by a restore) never goes, whatever its age.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CheckpointEntry", "checkpoints_to_remove"]


@dataclass(frozen=True)
class CheckpointEntry:
    """One ``collect-<seq>-<run>`` directory: its sequence number, run, whether it is published and for whom.

    ``collection`` is what its collector manifest names (the output file it collected into), None for
    an unpublished one or one whose manifest cannot be read.
    """

    seq: int
    run: str
    path: Path
    published: bool
    collection: str | None = None


def checkpoints_to_remove(
    entries: Iterable[CheckpointEntry], *, keep: int, collection: str, runs: Collection[str],
    in_use: Collection[Path] = (),
) -> list[Path]:
    """The directories the rule of the module docstring removes, oldest first."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, not {keep}")
    ordered = sorted(entries, key=lambda e: (e.seq, e.run))
    ours_published = [e for e in ordered if e.published and e.collection == collection]
    lineage = set(runs) | {e.run for e in ours_published}
    kept = {e.path for e in ours_published[-keep:]}
    busy = set(in_use)
    removable = []
    for entry in ordered:
        if entry.path in busy or entry.path in kept:
            continue
        if entry.published:
            if entry.collection == collection:
                removable.append(entry.path)
        elif entry.run in lineage:
            removable.append(entry.path)
    return removable
