"""What a checkpoint directory already holds of *other* checkpoints, before a commit writes into it.

Each participant refuses to replace its own manifest, but only its own: a commit into a directory
holding another deployment's checkpoint was refused by the one participant whose ``kind/instance``
both share, while every other participant wrote beside it. The good checkpoint then failed
``verify`` for every participant (its index no longer matched the directory) and was lost. The
controller therefore lists the directory first (``other_checkpoints``) and refuses before any
participant is called.

The listing goes through ``location`` (a filesystem path, or an object-store prefix with the
``fsspec`` backend), so it reads the same on both. It is a check before the commit, not a lock: a
writer that starts between the listing and the commit is stopped only where it meets a
participant's own manifest (created exclusively on both backends).
"""

from __future__ import annotations

import os

import orjson

from .._errors import InvalidCheckpointState
from .index import index_path, read_participants_index
from .layout import MANIFEST_NAME, MAX_MANIFEST_BYTES
from .location import Location, child_dirs, lexists, location, read_small
from .objstore import ObjectPath

__all__ = ["other_checkpoints"]


def other_checkpoints(checkpoint_dir: str | os.PathLike[str] | ObjectPath, checkpoint_id: str) -> list[str]:
    """One line per manifest or participants index in ``checkpoint_dir`` naming another checkpoint id.

    A manifest or index that cannot be read counts too (nothing says it is this checkpoint's);
    this checkpoint's own (a retried commit of the same id) does not.
    """
    root: Location = location(checkpoint_dir)
    found: list[str] = []
    index = index_path(root)
    if lexists(index):
        try:
            other = read_participants_index(root)
        except InvalidCheckpointState as exc:
            found.append(f"{index} cannot be read ({exc.detail})")
        else:
            if other is not None and other["checkpoint_id"] != checkpoint_id:
                found.append(f"{index} lists checkpoint {other['checkpoint_id']!r}")
    gym = root / "gym"
    try:
        kinds = child_dirs(gym)
    except (InvalidCheckpointState, OSError):
        # Not listable (a file where a directory must go, no permission): it holds no checkpoint this
        # check could find, and every participant's write fails there naming the cause.
        return found
    for kind in kinds:
        for instance in child_dirs(gym / kind):
            manifest = gym / kind / instance / MANIFEST_NAME
            if not lexists(manifest):
                continue
            try:
                held = orjson.loads(read_small(manifest, manifest.parent, MANIFEST_NAME, MAX_MANIFEST_BYTES))
                held_id = held.get("checkpoint_id") if isinstance(held, dict) else None
            except (InvalidCheckpointState, orjson.JSONDecodeError) as exc:
                found.append(f"{manifest} cannot be read ({getattr(exc, 'detail', exc)})")
                continue
            if held_id != checkpoint_id:
                found.append(f"{manifest} is of checkpoint {held_id!r}")
    return found
