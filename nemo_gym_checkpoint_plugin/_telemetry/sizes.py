"""The size of a published records file, for ``gym.checkpoint.size`` (None when it cannot be known)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["records_size"]


def records_size(checkpoint_dir: str, kind: str, instance: str, manifest: Mapping[str, Any]) -> int | None:
    """Bytes of the manifest's records file in the built-in layout (a stat, or a HEAD on an object store).

    None when the name is missing or the file is not where the built-in layout puts it (a storage
    backend of a plugin may write elsewhere): the metric then keeps its last value.
    """
    name = manifest.get("records_file")
    if not isinstance(name, str):
        return None
    from nemo_gym_checkpoint_plugin._storage.layout import participant_dir
    from nemo_gym_checkpoint_plugin._storage.location import location, size

    try:
        return size(participant_dir(location(checkpoint_dir), kind, instance) / name)
    except Exception:  # a backend's own layout, an unreachable store: the size is unknown, the commit is not
        return None
