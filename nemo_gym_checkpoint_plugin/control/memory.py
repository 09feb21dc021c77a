"""What the control plane remembers: the resumed ids (fencing) and the active operation (replay).

Replays only concern the active id: once it is resumed, every call naming it is
``stale_checkpoint``, so completed prepare/commit/restore replies live on the
``Active`` record and die with it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from nemo_gym_checkpoint_plugin.errors import CheckpointConflict, CheckpointError

from .types import PrepareReport

__all__ = ["RESUMED_MEMORY", "ResumedIds", "Active", "Replay"]

# PROTOCOL: the last 64 resumed ids are remembered.
RESUMED_MEMORY = 64


class ResumedIds:
    """The last ``RESUMED_MEMORY`` resumed checkpoint ids, oldest forgotten first."""

    def __init__(self, capacity: int = RESUMED_MEMORY) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity

    def __contains__(self, checkpoint_id: object) -> bool:
        return checkpoint_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def remember(self, checkpoint_id: str) -> None:
        # Resuming again refreshes the id, so the most recently resumed ids are the ones kept.
        self._ids.pop(checkpoint_id, None)
        self._ids[checkpoint_id] = None
        while len(self._ids) > self._capacity:
            self._ids.popitem(last=False)


@dataclass
class Replay:
    """One remembered operation: its arguments, the task doing it, then its reply or its error."""

    args: tuple[Any, ...]
    task: asyncio.Future[dict[str, Any]]

    def check_args(self, operation: str, checkpoint_id: str, args: tuple[Any, ...]) -> None:
        if args != self.args:
            raise CheckpointConflict(
                f"{operation} of {checkpoint_id} was already called with other arguments "
                f"(checkpoint_dir and scope must match the first call)",
                checkpoint_id=checkpoint_id,
            )


@dataclass
class Active:
    """The checkpoint (``operation == "checkpoint"``) or restore this participant is in."""

    checkpoint_id: str
    operation: str
    prepare_task: asyncio.Task[PrepareReport] | None = None
    prepare_reply: dict[str, Any] | None = None
    report: PrepareReport | None = None
    commit: Replay | None = None
    restore: Replay | None = None
    # Set once an export started: a failure there ends the checkpoint for good.
    export_error: CheckpointError | None = None
    writer: Any = None
    cleanup_task: asyncio.Task[None] | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
