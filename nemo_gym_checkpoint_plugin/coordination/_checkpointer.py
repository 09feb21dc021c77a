"""Checkpoints of a running collection: prepare, commit, the collector's state, resume; forgets; restore.

``CollectionCheckpointer`` runs beside Gym's collection on the same event loop:

- every ``every`` seconds, while rows are in flight, it checkpoints the deployment
  (failed attempts removed first, so what a full disk left of them is free again; then
  ``checkpoint_now``: ``prepare``; when ready, ``commit`` of the rows in flight minus the restarts
  into ``<root>/<checkpoint id>``; the collector's state written and published last; ``resume``,
  always, whatever failed), then removes this collection's checkpoints older than the ``keep``
  newest published ones (``_storage.retention``); ``checkpoint(budget=...)`` is the same checkpoint
  taken at once and bounded (``collect`` on SIGTERM: ``cli/_collect_drain.py``);
- between checkpoints it forgets, on every participant, the rollouts whose ``/run``
  returned (forget is refused while a checkpoint is open, so it never overlaps one);
- ``restore_from`` puts a published checkpoint back into fresh servers before the
  collection starts and says which attempt each row goes out as; until Gym dispatches those
  rows, every checkpoint carries them (a continued one committed at its replacement attempt,
  one starting over as it was), so a crash before their dispatch loses none.

``observe(event, data)`` (optional, may be async) is called at each step: ``prepare``,
``prepared``, ``committed``, ``records``, ``published``, ``resumed``, ``restored``,
``restore_failed``, ``retired``, ``lost_work``, ``forgot``, ``skipped``; progress displays and tests hook there.
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

from .._identity import capture_key, episode_to_wire
from ._checkpoint_now import CheckpointNow, checkpoint_now
from ._collection import RunTracker
from ._collector_state import CheckpointStore, CollectorState, RowState
from ._coordinator import Coordinator
from ._errors import CoordinationError
from ._ledger import LostWork, ledger_counts, lost_work

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
    # Restarts and uncaptured rows retired everywhere at their checkpointed attempt, sent as the next one.
    retired: list[str] = field(default_factory=list)
    # What the crash cost (coordination._ledger), once the restore decided every row.
    lost_work: LostWork | None = None


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
        if store.collection is None:
            # What names this collection in its checkpoints (deployment_identity's output): prune keeps to it.
            store.collection = str(self.output_path.resolve())
        self.timeout = timeout
        self.observe = observe
        self.seq = store.next_seq()
        self.checkpoints: list[CheckpointRecord] = []
        self.last_published_at: float | None = None
        self.forgotten = 0
        self._stop = asyncio.Event()
        # One checkpoint or forget at a time: a checkpoint on SIGTERM waits for the periodic one under way.
        self._busy = asyncio.Lock()

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
            if self.tracker.in_flight or self.tracker.awaiting:
                await self.checkpoint()
        await self.forget_final()

    async def forget_final(self) -> None:
        """Forget, on every participant, each rollout whose ``/run`` returned since the last call."""
        async with self._busy:
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

    async def checkpoint(self, budget: float | None = None) -> CheckpointRecord:
        """One checkpoint of the deployment and the collector (``checkpoint_now``); the deployment is resumed
        whatever happens. ``budget`` (None: each call bounded by ``timeout`` alone) bounds it from this call,
        the wait for a checkpoint or forget already under way included: at its end nothing is published.
        Cancelled, it records the attempt (not published, the deployment resumed) and re-raises."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(budget):
                await self._busy.acquire()
        except TimeoutError:
            record = CheckpointRecord(
                self.store.checkpoint_id(self.seq),
                published=False,
                problem=f"the budget of {budget:g}s ended before the checkpoint under way did",
            )
            self.checkpoints.append(record)
            await self._emit("resumed", checkpoint=record.checkpoint_id, record=record)
            return record
        try:
            left = None if budget is None else max(budget - (time.monotonic() - started), 0.0)
            return await self._checkpoint(left)
        finally:
            self._busy.release()

    async def _checkpoint(self, budget: float | None) -> CheckpointRecord:
        checkpoint_id = self.store.checkpoint_id(self.seq)
        self.seq += 1
        record = CheckpointRecord(checkpoint_id, published=False)
        # Failed attempts go before this one writes: what a full disk left of them is space again.
        await asyncio.to_thread(self._prune, [self.store.path(checkpoint_id)])
        in_flight: dict[str, int] = {}
        carried: list[RowState] = []

        def episodes() -> list[dict[str, Any]]:
            in_flight.update(self.tracker.in_flight)
            # Restored rows not dispatched yet: a continued one is committed at its replacement attempt (its
            # restored state is pending on the servers, and a commit deletes restored state outside its
            # scope); one starting over is carried as the last checkpoint had it.
            for rollout_id, (attempt, row_state) in self.tracker.awaiting.items():
                if rollout_id in in_flight:
                    continue
                if row_state == "continued":
                    in_flight[rollout_id] = attempt
                else:
                    carried.append(RowState(rollout_id, attempt, row_state))
            return [{"rollout_id": r, "attempt": a} for r, a in in_flight.items()]

        async def publish(now: CheckpointNow) -> dict[str, Any]:
            return await self._publish(now, record, in_flight, carried)

        try:
            now = await checkpoint_now(
                self.coordinator,
                checkpoint_id,
                # Made here, exclusively, before any participant writes into it: never a directory someone planted.
                lambda: self.store.create(checkpoint_id),
                episodes,
                budget=budget,
                timeout=self.timeout,
                publish=publish,
                observe=self.observe,
                resume_timeout=self.timeout,
            )
        except asyncio.CancelledError:
            record.problem = record.problem or "stopped before it was published"
            self.checkpoints.append(record)
            raise
        record.published = now.published
        record.prepare_s, record.paused_s = now.prepare_s, now.paused_s
        if now.published:
            record.commit_s = now.commit_s
            self.last_published_at = time.monotonic()
        record.problem = now.problem
        if now.problem is not None:
            logger.warning("checkpoint %s%s: %s", checkpoint_id, "" if now.published else " not published", now.problem)
        self.checkpoints.append(record)
        await self._emit("resumed", checkpoint=checkpoint_id, record=record)
        if record.published:
            # Off the loop (as before each attempt): on an object store, listing and removing are network calls.
            await asyncio.to_thread(self._prune, ())
        return record

    def _prune(self, in_use: Iterable[Any]) -> None:
        """The retention rule (``_storage.retention``): older published checkpoints and failed attempts of this
        collection; never ``in_use``."""
        for path in self.store.prune(self.keep, in_use=in_use):
            logger.info("removed checkpoint %s", path)

    async def _publish(
        self, now: CheckpointNow, record: CheckpointRecord, in_flight: dict[str, int], carried: list[RowState]
    ) -> dict[str, Any]:
        """``checkpoint_now``'s last step: the collector's state beside the Gym records, its manifest last."""
        assert now.prepared is not None and now.committed is not None and now.commit_started is not None
        checkpoint_id, target = now.checkpoint_id, now.checkpoint_dir
        restarts = set(now.prepared.restarts())
        written: set[str] = set()
        for keys in now.committed.episode_ids.values():
            written.update(keys)
        counts = ledger_counts(now.committed.replies)
        answered, held, running = counts["answered_calls"], counts["held_calls"], counts["running_calls"]
        tools = counts["answered_tool_calls"]
        tokens, held_tokens = counts["answered_output_tokens"], counts["held_output_tokens"]
        # Tokens only when some model server's answers reported usage: 0 would claim nothing was generated.
        tokens_reported = bool(tokens)
        reported = any("answered_calls" in reply for reply in now.committed.replies.values())
        tools_reported = any("answered_tool_calls" in reply for reply in now.committed.replies.values())
        rows = []
        for rollout_id, attempt in in_flight.items():
            key = capture_key(rollout_id, attempt)
            row_state = "restart" if key in restarts else "continued" if key in written else "uncaptured"
            rows.append(
                RowState(
                    rollout_id,
                    attempt,
                    row_state,
                    model_calls=answered.get(key, 0) if reported else None,
                    held_calls=held.get(key, 0) if reported else None,
                    running_calls=running.get(key, 0) if reported else None,
                    tool_calls=tools.get(key, 0) if tools_reported else None,
                    output_tokens=tokens.get(key, 0) if tokens_reported else None,
                    held_output_tokens=held_tokens.get(key, 0) if tokens_reported else None,
                )
            )
        rows.extend(carried)
        record.continued = sum(1 for r in rows if r.state == "continued")
        record.restarts = sum(1 for r in rows if r.state == "restart")
        state = CollectorState(
            checkpoint_id=checkpoint_id,
            deployment=self.deployment,
            rows=rows,
            finished={
                "rows": self.tracker.returned,
                "output": str(self.output_path.resolve()),
                "output_bytes": _size(self.output_path),
            },
            timings={
                "prepare_s": round(now.prepare_s, 6),
                "commit_s": round(time.monotonic() - now.commit_started, 6),
                # Wall clock: the ledger's time since the last published checkpoint, read by another process.
                "published_at": round(time.time(), 3),
            },
        )
        digest, count = await asyncio.to_thread(self.store.write_records, state)
        await self._emit("records", checkpoint=checkpoint_id, path=target)
        # The manifest is created in one step: once begun it is finished, and said, even when the budget
        # ends or a second signal comes meanwhile (never "nothing published" about a published checkpoint).
        publishing = asyncio.ensure_future(asyncio.to_thread(self.store.publish, state, digest, count))
        try:
            await asyncio.shield(publishing)
        except asyncio.CancelledError:
            await publishing
            now.published = True
            raise
        return {"continued": record.continued}

    # -- resuming -------------------------------------------------------------------------------

    async def restore_from(self, state: CollectorState, finished: Iterable[str]) -> RestorePlan:
        """Restore ``state``'s continued rows not ``finished`` into the (fresh) deployment and resume it.

        Continued rows go out as the replacement attempt the restore installed; on a failed
        restore they start over as the attempt the coordination library names (past the
        retired ones), never lost. Every other row (a restart, one no participant captured)
        starts over from its input as its next attempt, once its checkpointed attempt is
        retired everywhere (``retire_starting_over``); a failed retire raises ``CoordinationError``
        before anything is dispatched.
        """
        done = set(finished)
        plan = RestorePlan(source=state.checkpoint_id)
        wanted = [row for row in state.by_state("continued") if row.rollout_id not in done]
        starting_over = [row for row in state.rows if row.state != "continued" and row.rollout_id not in done]
        plan.restarted = [row.rollout_id for row in starting_over]
        if wanted:
            await self._restore_continued(state, wanted, plan)
        if starting_over:
            await self.retire_starting_over(starting_over, plan)
        # Until Gym dispatches them, the next checkpoint carries them (RunTracker.awaiting).
        continued = set(plan.continued)
        states = {row.rollout_id: row.state for row in state.rows}
        for rollout_id, attempt in plan.attempts.items():
            if rollout_id in continued:
                self.tracker.awaiting[rollout_id] = (attempt, "continued")
            else:
                # Starting over as ``attempt``: retired up to the one before, which the next resume retires again.
                row_state = states.get(rollout_id, "uncaptured")
                self.tracker.awaiting[rollout_id] = (
                    attempt - 1,
                    "uncaptured" if row_state == "continued" else row_state,
                )
        plan.lost_work = lost_work(
            state.checkpoint_id,
            state.rows,
            plan.continued,
            plan.restarted,
            done,
            published_at=state.timings.get("published_at"),
            restored_at=time.time(),
        )
        await self._emit("lost_work", checkpoint=state.checkpoint_id, ledger=plan.lost_work.to_json())
        return plan

    async def retire_starting_over(self, rows: list[RowState], plan: RestorePlan) -> None:
        """Retire ``rows`` at their checkpointed attempt everywhere; each goes out as the next one.

        The same attempt again would share its capture key with the dead execution: a harness that
        outlived the crash could write into the rerun, and with token capture on the rerun's rows
        would land beside the dead one's, so Gym's rebuild masks the sample. A retire that fails
        anywhere raises: sending the rows without their marks would give up that guarantee.
        """
        retire_id = f"retire-{self.seq:06d}-{self.store.run}"
        self.seq += 1
        scope = [episode_to_wire(row) for row in rows]
        await self.coordinator.retire(retire_id, scope, timeout=self.timeout)
        for row in rows:
            plan.attempts[row.rollout_id] = max(plan.attempts.get(row.rollout_id, 0), row.attempt + 1)
        plan.retired = [row.rollout_id for row in rows]
        await self._emit("retired", checkpoint=plan.source, episodes={row.rollout_id: row.attempt for row in rows})

    async def _restore_continued(self, state: CollectorState, wanted: list[RowState], plan: RestorePlan) -> None:
        restore_id = f"restore-{self.seq:06d}-{self.store.run}"
        self.seq += 1
        started = time.monotonic()
        scope = [episode_to_wire(row) for row in wanted]
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
            return
        await self.coordinator.resume(restore_id, timeout=self.timeout)
        plan.restore_s = time.monotonic() - started
        back = set(restored.restored())
        for row in wanted:
            # The restore retired the checkpointed attempt everywhere: what it did not install starts over.
            plan.attempts[row.rollout_id] = row.attempt + 1
            replacement = capture_key(row.rollout_id, row.attempt + 1)
            (plan.continued if replacement in back else plan.restarted).append(row.rollout_id)
        # Their marks are forgotten once they are final, like every other row's.
        await self._emit(
            "restored",
            checkpoint=state.checkpoint_id,
            path=str(state.path),
            continued=list(plan.continued),
            restarted=list(plan.restarted),
        )


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0
