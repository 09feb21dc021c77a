"""Checkpoints of a running collection: prepare, commit, the collector's state, resume; forgets; restore.

``CollectionCheckpointer`` runs beside Gym's collection on the same event loop:

- every ``every`` seconds, while rows are in flight, it checkpoints the deployment
  (``prepare``; when ready, ``commit`` of the rows in flight minus the restarts into
  ``<root>/<checkpoint id>``; the collector's state written and published last), then
  ``resume`` (always, whatever failed), then removes checkpoints older than the ``keep``
  newest published ones;
- between checkpoints it forgets, on every participant, the rollouts whose ``/run``
  returned (forget is refused while a checkpoint is open, so it never overlaps one);
- ``restore_from`` puts a published checkpoint back into fresh servers before the
  collection starts and says which attempt each row goes out as.

``observe(event, data)`` (optional, may be async) is called at each step: ``prepare``,
``prepared``, ``committed``, ``records``, ``published``, ``resumed``, ``restored``,
``restore_failed``, ``forgot``, ``skipped``; progress displays and tests hook there.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import InvalidCheckpointState
from ._collection import RunTracker
from ._collector_state import CheckpointStore, CollectorState, RowState
from ._coordinator import Coordinator
from ._errors import CoordinationError

__all__ = ["CheckpointRecord", "CollectionCheckpointer", "RestorePlan"]

logger = logging.getLogger(__name__)

Observer = Callable[[str, dict[str, Any]], Any]


@dataclass
class CheckpointRecord:
    """One checkpoint attempt: what it cost and what it holds."""

    checkpoint_id: str
    published: bool
    prepare_s: float = 0.0
    commit_s: float = 0.0
    paused_s: float = 0.0
    continued: int = 0
    restarts: int = 0
    problem: str | None = None


@dataclass
class RestorePlan:
    """What a resume does with the rows of a checkpoint."""

    source: str | None = None
    attempts: dict[str, int] = field(default_factory=dict)
    continued: list[str] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)
    restore_s: float = 0.0
    problem: str | None = None
    fallbacks: list[tuple[str, str]] = field(default_factory=list)


class CollectionCheckpointer:
    def __init__(
        self,
        coordinator: Coordinator,
        store: CheckpointStore,
        tracker: RunTracker,
        *,
        every: float,
        keep: int,
        deployment: dict[str, Any],
        output_path: str | Path,
        timeout: float = 60.0,
        observe: Observer | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.store = store
        self.tracker = tracker
        self.every = every
        self.keep = keep
        self.deployment = deployment
        self.output_path = Path(output_path)
        self.timeout = timeout
        self.observe = observe
        self.seq = store.next_seq()
        self.checkpoints: list[CheckpointRecord] = []
        self.last_published_at: float | None = None
        self.forgotten = 0
        self._stop = asyncio.Event()

    async def _emit(self, event: str, **data: Any) -> None:
        if self.observe is not None:
            outcome = self.observe(event, data)
            if inspect.isawaitable(outcome):
                await outcome

    # -- the loop -------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Checkpoint every ``every`` seconds while rows are in flight, until ``stop``."""
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=self.every)
            except TimeoutError:
                pass
            if self._stop.is_set():
                break
            await self.forget_final()
            if self.tracker.in_flight:
                await self.checkpoint()
        await self.forget_final()

    async def forget_final(self) -> None:
        """Forget, on every participant, each rollout whose ``/run`` returned since the last call."""
        final = self.tracker.take_final()
        if not final:
            return
        try:
            await self.coordinator.forget(f"forget-{self.seq:06d}-{self.store.run}", final, timeout=self.timeout)
        except CoordinationError as exc:
            # Marks are bounded bookkeeping: a failed forget is retried with the next batch.
            self.tracker.final[:0] = final
            logger.warning("forget failed (retried later): %s", exc)
            return
        self.forgotten += len(final)
        await self._emit("forgot", rollouts=len(final))

    async def checkpoint(self) -> CheckpointRecord:
        """One checkpoint of the deployment and the collector; the deployment is resumed whatever happens."""
        checkpoint_id = self.store.checkpoint_id(self.seq)
        self.seq += 1
        record = CheckpointRecord(checkpoint_id, published=False)
        started = time.monotonic()
        try:
            await self._checkpoint(checkpoint_id, record, started)
        except (CoordinationError, InvalidCheckpointState) as exc:
            record.problem = str(exc).splitlines()[0]
            logger.warning("checkpoint %s not published: %s", checkpoint_id, exc)
        finally:
            try:
                await self.coordinator.resume(checkpoint_id, timeout=self.timeout)
            except CoordinationError as exc:
                record.problem = record.problem or f"resume: {str(exc).splitlines()[0]}"
                logger.warning("resume of %s failed: %s", checkpoint_id, exc)
            record.paused_s = time.monotonic() - started
            self.checkpoints.append(record)
        await self._emit("resumed", checkpoint=checkpoint_id, record=record)
        if record.published:
            # Off the loop: on an object store, listing and removing are network calls.
            for path in await asyncio.to_thread(self.store.prune, self.keep):
                logger.info("removed checkpoint %s", path)
        return record

    async def _checkpoint(self, checkpoint_id: str, record: CheckpointRecord, started: float) -> None:
        await self._emit("prepare", checkpoint=checkpoint_id)
        prepared = await self.coordinator.prepare(checkpoint_id, timeout=self.timeout)
        record.prepare_s = time.monotonic() - started
        if not prepared.ready:
            record.problem = f"not ready by the deadline ({prepared.blocker_count()} blockers)"
            await self._emit("skipped", checkpoint=checkpoint_id, why=record.problem)
            return
        await self._emit("prepared", checkpoint=checkpoint_id)
        restarts = set(prepared.restarts())
        in_flight = dict(self.tracker.in_flight)
        scope = prepared.continued(self.tracker.episodes())
        committed_at = time.monotonic()
        target = self.store.path(checkpoint_id)
        committed = await self.coordinator.commit(checkpoint_id, str(target), scope, timeout=self.timeout)
        written: set[str] = set()
        for keys in committed.episode_ids.values():
            written.update(keys)
        await self._emit("committed", checkpoint=checkpoint_id)
        rows = []
        for rollout_id, attempt in in_flight.items():
            key = rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"
            state = "restart" if key in restarts else "continued" if key in written else "uncaptured"
            rows.append(RowState(rollout_id, attempt, state))
        record.continued = sum(1 for r in rows if r.state == "continued")
        record.restarts = sum(1 for r in rows if r.state == "restart")
        state = CollectorState(
            checkpoint_id=checkpoint_id, deployment=self.deployment, rows=rows,
            finished={"rows": self.tracker.returned, "output": str(self.output_path.resolve()),
                      "output_bytes": _size(self.output_path)},
            timings={"prepare_s": round(record.prepare_s, 6), "commit_s": round(time.monotonic() - committed_at, 6)},
        )
        digest, count = await asyncio.to_thread(self.store.write_records, state)
        await self._emit("records", checkpoint=checkpoint_id, path=str(target))
        await asyncio.to_thread(self.store.publish, state, digest, count)
        record.commit_s = time.monotonic() - committed_at
        record.published = True
        self.last_published_at = time.monotonic()
        await self._emit("published", checkpoint=checkpoint_id, path=str(target), continued=record.continued)

    # -- resuming -------------------------------------------------------------------------------

    async def restore_from(self, state: CollectorState, finished: Iterable[str]) -> RestorePlan:
        """Restore ``state``'s continued rows not ``finished`` into the (fresh) deployment and resume it.

        Continued rows go out as the replacement attempt the restore installed; on a failed
        restore they start over as the attempt the coordination library names (past the
        retired ones), never lost. Every other row starts over from its input.
        """
        done = set(finished)
        plan = RestorePlan(source=state.checkpoint_id)
        wanted = [row for row in state.by_state("continued") if row.rollout_id not in done]
        plan.restarted = [row.rollout_id for row in state.rows
                          if row.state != "continued" and row.rollout_id not in done]
        if not wanted:
            return plan
        restore_id = f"restore-{self.seq:06d}-{self.store.run}"
        self.seq += 1
        started = time.monotonic()
        scope = [{"rollout_id": row.rollout_id, "attempt": row.attempt} for row in wanted]
        try:
            restored = await self.coordinator.restore(restore_id, str(state.path), scope, timeout=self.timeout)
        except CoordinationError as exc:
            plan.restore_s = time.monotonic() - started
            plan.problem = str(exc).splitlines()[0]
            next_attempts = (exc.result or {}).get("next_attempts") or {}
            for row in wanted:
                plan.attempts[row.rollout_id] = int(next_attempts.get(row.rollout_id, row.attempt + 2))
                plan.restarted.append(row.rollout_id)
            await self._emit("restore_failed", checkpoint=state.checkpoint_id, why=plan.problem)
            return plan
        await self.coordinator.resume(restore_id, timeout=self.timeout)
        plan.restore_s = time.monotonic() - started
        back = set(restored.restored())
        for row in wanted:
            # The restore retired the checkpointed attempt everywhere: what it did not install starts over.
            plan.attempts[row.rollout_id] = row.attempt + 1
            replacement = f"{row.rollout_id}-a{row.attempt + 1}"
            (plan.continued if replacement in back else plan.restarted).append(row.rollout_id)
        # Their marks are forgotten once they are final, like every other row's.
        await self._emit("restored", checkpoint=state.checkpoint_id, path=str(state.path),
                         continued=list(plan.continued), restarted=list(plan.restarted))
        return plan


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0
