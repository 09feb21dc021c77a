"""Checkpoints of one in-process ``ControlPlane`` into sibling directories, and what each one wrote.

The built-in participants export ``Versioned`` records: a checkpoint written beside the server's
previous one refers to every record whose version did not change (docs/protocol.md, "Incremental
checkpoints"). ``written`` reads a checkpoint's own records file: the records it wrote this time.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

from nemo_gym_checkpoint_plugin._control import ControlPlane
from nemo_gym_checkpoint_plugin._identity import EpisodeId, capture_key
from nemo_gym_checkpoint_plugin._storage.layout import MANIFEST_NAME, participant_dir

__all__ = ["checkpoint", "manifest_of", "restore", "written"]


def _deadline() -> float:
    return time.time() + 20.0


async def checkpoint(
    plane: ControlPlane,
    root: Path,
    name: str,
    scope: Iterable[EpisodeId] | None = None,
    checkpoint_id: str | None = None,
) -> dict[str, Any]:
    """Prepare, commit into ``root/name`` and resume (the id: ``checkpoint_id``, else ``name``); the commit's reply."""
    ident = checkpoint_id or name
    prepared = await plane.prepare(ident, _deadline())
    assert prepared["phase"] == "prepared" and prepared["report"]["ready"], prepared
    committed = await plane.commit(ident, _deadline(), str(root / name), None if scope is None else list(scope))
    await plane.resume(ident, _deadline())
    return committed


async def restore(plane: ControlPlane, directory: Path, scope: Iterable[EpisodeId]) -> dict[str, Any]:
    """Restore ``directory`` into ``plane`` and resume; the restore's reply."""
    restored = await plane.restore("re-" + directory.name, _deadline(), str(directory), list(scope))
    await plane.resume("re-" + directory.name, _deadline())
    return restored


def manifest_of(directory: Path, kind: str, instance: str) -> dict[str, Any]:
    return orjson.loads((participant_dir(directory, kind, instance) / MANIFEST_NAME).read_bytes())


def written(directory: Path, kind: str, instance: str) -> list[str]:
    """The capture keys of the records ``directory``'s checkpoint wrote itself (not those it refers to), in order."""
    manifest = manifest_of(directory, kind, instance)
    lines = (participant_dir(directory, kind, instance) / manifest["records_file"]).read_bytes().splitlines()
    keys = []
    for line in lines:
        episode = orjson.loads(line)["episode_id"]
        keys.append(capture_key(episode["rollout_id"], episode["attempt"]))
    return keys
