"""Helpers for storage tests: records that look like a participant's, and a write through the backend."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fsspec.implementations.memory import MemoryFileSystem

from nemo_gym_checkpoint_plugin._storage import CheckpointWriter


def record(rollout_id: str, attempt: int = 0, **fields: Any) -> dict[str, Any]:
    return {"episode_id": {"rollout_id": rollout_id, "attempt": attempt}, **fields}


def write(
    root: Path,
    records: list[dict],
    *,
    kind: str = "model",
    instance: str = "policy_model",
    checkpoint_id: str = "step-1",
    extras: dict | None = None,
) -> dict:
    return CheckpointWriter(root, kind, instance, checkpoint_id).write(records, extras)


def fd_count() -> int:
    """Open file descriptors of this process (to show that nothing leaks)."""
    return len(os.listdir("/proc/self/fd"))


class LenientMemoryFileSystem(MemoryFileSystem):
    """A store that ignores exclusive creates (as some S3-compatible stores ignore If-None-Match):
    fsspec's in-memory filesystem whose ``pipe_file`` overwrites whatever mode it is asked for."""

    protocol = ("lenient",)
    store: dict = {}  # noqa: RUF012 - fsspec's own convention: the class holds the contents
    pseudo_dirs = [""]  # noqa: RUF012

    def pipe_file(self, path, value, mode="overwrite", **kwargs):  # noqa: ANN001, ANN003, ANN201
        return super().pipe_file(path, value, mode="overwrite", **kwargs)
