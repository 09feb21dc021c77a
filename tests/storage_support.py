"""Helpers for storage tests: records that look like a participant's, and a write through the backend."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nemo_gym_checkpoint_plugin._storage import CheckpointWriter


def record(rollout_id: str, attempt: int = 0, **fields: Any) -> dict[str, Any]:
    return {"episode_id": {"rollout_id": rollout_id, "attempt": attempt}, **fields}


def write(root: Path, records: list[dict], *, kind: str = "model", instance: str = "policy_model",
          checkpoint_id: str = "step-1", extras: dict | None = None) -> dict:
    return CheckpointWriter(root, kind, instance, checkpoint_id).write(records, extras)


def fd_count() -> int:
    """Open file descriptors of this process (to show that nothing leaks)."""
    return len(os.listdir("/proc/self/fd"))
