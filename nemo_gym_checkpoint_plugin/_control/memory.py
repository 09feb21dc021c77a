"""What the control plane remembers: the resumed ids (fencing) and the active operation (replay).

Replays only concern the active id: once it is resumed, every call naming it is
``stale_checkpoint``, so completed prepare/commit/restore replies live on the
``Active`` record and die with it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from nemo_gym_checkpoint_plugin._errors import CheckpointConflict, CheckpointError

from .._types import PrepareReport

__all__ = ["RESUMED_MEMORY", "ResumedIds", "Active", "Replay", "KeptExport"]

# docs/protocol.md: the last 64 resumed ids are remembered.
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
    task: asyncio.Task[dict[str, Any]]

    def check_args(self, operation: str, checkpoint_id: str, args: tuple[Any, ...], *, any_dir: bool = False) -> None:
        """Refuse other arguments (``checkpoint_conflict``); ``any_dir``: the directory (``args[0]``) may differ."""
        if args[any_dir:] != self.args[any_dir:]:
            what = "scope and stop" if any_dir else "checkpoint_dir and scope"
            raise CheckpointConflict(
                f"{operation} of {checkpoint_id} was already called with other arguments "
                f"({what} must match the first call)",
                checkpoint_id=checkpoint_id,
            )


class KeptExport:
    """An export kept until its checkpoint ends, so a write that failed can be retried with the same cut.

    ``records`` is the export's iterator, consumed once (lazily, by the writer's thread); every record
    it yields is cached, so a later write replays the cached ones, then continues from where the
    failed write stopped. A failure *inside* the iterator (the participant's, not the filesystem's)
    is noted in ``source_error``: it ends the checkpoint, whatever the writer made of it.
    """

    def __init__(self, records: Iterable[Any], manifest_extras: Mapping[str, Any], reply_extras: Mapping[str, Any]):
        self._source: Iterator[Any] | None = iter(records)
        self._cache: list[Any] = []
        self.manifest_extras = manifest_extras
        self.reply_extras = reply_extras
        self.source_error: BaseException | None = None
        # Capture keys of the records consumed so far (the commit's scoping notes them): the reply's episode_ids.
        self.written: list[str] = []

    def replay(self) -> Iterator[Any]:
        """Every record of the export, in its order: the cached ones, then the rest of the source."""
        # No lock: a retry starts only once the last write's task ended (its thread is done with this).
        yield from self._cache
        while self._source is not None:
            try:
                record = next(self._source)
            except StopIteration:
                self._source = None
                return
            except BaseException as exc:
                self.source_error = exc
                raise
            self._cache.append(record)
            yield record

    def release(self) -> None:
        """The write succeeded: a retry replays the reply, so the records need not stay in memory."""
        self._cache = []
        self._source = None


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
    # Set when the export failed, or readiness regressed before it: the checkpoint is over for good.
    export_error: CheckpointError | None = None
    # The export, once it succeeded, until the checkpoint ends (a failed write is retried with it).
    kept: KeptExport | None = None
    # The last write's WriteFailed, until a retry starts another write.
    write_error: CheckpointError | None = None
    writer: Any = None
    # A commit replied deadline_exceeded: writes are stopped (none may publish after that reply) until a retry.
    writes_stopped: bool = False
    # How many times a commit's deadline stopped the writes: a retry waiting for a stopped write knows
    # whether its own deadline stopped it meanwhile (then it writes nothing either).
    stops: int = 0
    cleanup_task: asyncio.Task[None] | None = None
    # The commit scope whose deletion of unscoped restored state failed: a retried commit deletes again.
    delete_failed: frozenset[str] | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    # The frozen heap (_gc_pause.py) from the checkpoint's or restore's beginning until it ends.
    heap: Any = None

    def cancel_tasks(self) -> None:
        """Cancel the operation's own tasks, all but the one calling (it is ending the operation)."""
        current = asyncio.current_task()
        for task in list(self.tasks):
            if task is not current:
                task.cancel()
