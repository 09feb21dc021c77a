"""The control plane of one participant server: phases, fencing, replay, lease, admission.

docs/protocol.md's "Phases" section, exactly:

- one ``asyncio.Lock`` serializes transitions; long work (waiting for readiness, the
  export and write, reading and installing a restore, stopping retired work) runs in
  tasks outside it, so a resume can always get in and abort them;
- fencing: a resumed id (the last 64) is ``stale_checkpoint``; another id while one is
  active is ``checkpoint_conflict``; the right id in the wrong phase ``invalid_phase``;
- completed prepare/commit/restore are remembered on the active operation and replayed
  to a retry with the same arguments (a retry while the work runs joins it);
- phase and admission never disagree: every path back to ``idle`` reopens admission,
  except that it waits for an install still running. When a participant's
  ``open_admission`` hook raises (the plane's own gate is open all the same), the reopening
  stays pending: the next resume retries it, even a resume of an id already resumed or
  while idle (then ``idempotent: false``), and a resume whose reopening failed replies
  ``invalid_phase`` (``AdmissionNotReopened``) naming the hook's error, so the controller
  resumes again;
- ``deadline_ts`` must be ahead of the plane's clock (else ``deadline_exceeded``) and at most
  ``MAX_DEADLINE_AHEAD_SECONDS`` (24 hours) ahead (else ``DeadlineTooFar``, a 422 body error on
  the routes): a deadline in milliseconds would make the lease endless.

This module holds the state and the checkpoint path (prepare, commit, renew, resume,
status); ``restore.py`` adds restore, retire and forget.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import pluggy

from nemo_gym_checkpoint_plugin._admission import Admission, RetiredMarks
from nemo_gym_checkpoint_plugin._collector import hold_heap
from nemo_gym_checkpoint_plugin._errors import (
    CheckpointConflict,
    DeadlineExceeded,
    InvalidPhase,
    StaleCheckpoint,
)
from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._settings import CheckpointSettings

from .._types import (
    MAX_DEADLINE_AHEAD_SECONDS,
    AdmissionNotReopened,
    DeadlineTooFar,
    LeasePolicy,
    Phase,
    PrepareReport,
    rollout_attempts,
)
from .commit import CommitMixin
from .facade import Participants
from .lease import Lease
from .memory import Active, ResumedIds
from .owner import OwnerLease
from .restore import RestoreMixin

__all__ = ["ControlPlane"]

logger = logging.getLogger(__name__)

# Marks set between two yields to the event loop: a retire of 200,000 ids never holds data traffic long.
_MARKS_PER_YIELD = 4096
# Marks named in ``status`` (``retired_marks``); ``retired_rollouts`` counts every one.
RETIRED_MARKS_SHOWN = 100


class ControlPlane(CommitMixin, RestoreMixin):
    """Everything one server process knows about checkpoints. Use from its event loop only.

    ``admission`` and ``marks`` are the state the admission gate reads. ``storage`` and
    ``lease_policy`` default to the manager's ``storage_backend`` / ``lease_policy`` answers
    for ``settings``; tests inject them (e.g. a short ``retry_seconds``).
    """

    def __init__(
        self,
        pm: pluggy.PluginManager,
        *,
        kind: str,
        instance: str,
        settings: CheckpointSettings | None = None,
        storage: Any = None,
        lease_policy: LeasePolicy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from nemo_gym_checkpoint_plugin._plugins import get_storage_backend

        settings = settings or CheckpointSettings(enabled=True)
        self.kind = kind
        self.instance = instance
        self.pm = pm
        self.participants = Participants(pm)
        self.admission = Admission()
        self.marks = RetiredMarks()
        self._storage = storage if storage is not None else get_storage_backend(pm, settings.storage)
        policy = lease_policy if lease_policy is not None else pm.hook.lease_policy(settings=settings)
        if not isinstance(policy, LeasePolicy):
            raise TypeError(f"lease_policy hook answered {policy!r}, not a LeasePolicy")
        self._clock = clock
        self.lease = Lease(policy, self._self_resume, clock)
        # One controller per deployment (owner.py): checked by the routes before each control call.
        self.owners = OwnerLease(policy, clock)
        self.phase = Phase.IDLE
        self._lock = asyncio.Lock()
        self._active: Active | None = None
        self._resumed = ResumedIds()
        self._install_task: asyncio.Task[None] | None = None
        # A participant's open_admission hook that raised: (checkpoint id, error), retried by the next resume.
        self._reopen_failed: tuple[str, Exception] | None = None
        self._background: set[asyncio.Task[Any]] = set()

    # -- shared helpers --------------------------------------------------------------------------

    @property
    def checkpoint_id(self) -> str | None:
        return None if self._active is None else self._active.checkpoint_id

    def _check_deadline(self, deadline_ts: float) -> None:
        # Refused before anything changes: a late prepare does not even close admission.
        now = self._clock()
        if deadline_ts <= now:
            raise DeadlineExceeded(f"deadline_ts {deadline_ts} has already passed", deadline_ts=deadline_ts)
        if deadline_ts - now > MAX_DEADLINE_AHEAD_SECONDS:
            # A deadline in milliseconds (1.7e12) would make the lease, deadline + grace, endless.
            raise DeadlineTooFar(deadline_ts, now)

    async def _mark_all(self, episodes: Sequence[EpisodeId]) -> None:
        """Mark each episode retired up to its attempt (under the lock), yielding to other work in between."""
        for count, (rollout_id, attempt) in enumerate(rollout_attempts(episodes), 1):
            self.marks.mark(rollout_id, attempt)
            if count % _MARKS_PER_YIELD == 0:
                await asyncio.sleep(0)

    def _remaining(self, deadline_ts: float) -> float:
        return max(0.0, deadline_ts - self._clock())

    def _fence(self, checkpoint_id: str) -> Active | None:
        if checkpoint_id in self._resumed:
            raise StaleCheckpoint(f"checkpoint {checkpoint_id} was already resumed", checkpoint_id=checkpoint_id)
        active = self._active
        if active is not None and active.checkpoint_id != checkpoint_id:
            raise CheckpointConflict(
                f"{active.operation} {active.checkpoint_id} is active (phase {self.phase}); "
                f"{checkpoint_id} must wait for its resume",
                checkpoint_id=checkpoint_id,
                active=active.checkpoint_id,
            )
        return active

    def _spawn(self, coro: Coroutine[Any, Any, Any], active: Active | None = None) -> asyncio.Task[Any]:
        """A task kept referenced until done; an active operation's tasks are cancelled by its resume."""
        task = asyncio.get_running_loop().create_task(coro)
        owner = active.tasks if active is not None else self._background
        owner.add(task)
        task.add_done_callback(owner.discard)
        # Errors reach callers through the shielded awaits; retrieving here keeps the loop quiet.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _joined(self, task: asyncio.Future[Any], deadline_ts: float, what: str) -> Any:
        """Await shared work within this call's deadline, without cancelling it for the others."""
        try:
            return await asyncio.wait_for(asyncio.shield(task), self._remaining(deadline_ts))
        except TimeoutError:
            raise DeadlineExceeded(f"{what} did not finish before deadline_ts {deadline_ts}") from None
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                raise StaleCheckpoint(f"{what} was aborted by a resume") from None
            raise

    async def _begin(self, active: Active, deadline_ts: float, phase: Phase) -> None:
        """Enter ``phase`` with admission closed (under the lock). A raising close hook reverts it all."""
        self._active = active
        self.phase = phase
        # No full collection of the heap inside the checkpoint or restore (_collector.py); released at idle.
        active.heap = hold_heap()
        self.admission.close()
        try:
            await self.participants.close_admission(active.checkpoint_id)
        except BaseException:
            await self._back_to_idle(active)
            raise
        self.lease.extend(deadline_ts)

    async def _back_to_idle(self, active: Active) -> None:
        """End ``active`` (under the lock): cancel its tasks, clear the lease, reopen admission."""
        if self._active is not active:
            return
        self._active = None
        self.phase = Phase.IDLE
        self.lease.clear()
        if active.heap is not None:
            active.heap.release()
        current = asyncio.current_task()
        for task in list(active.tasks):
            if task is not current:
                task.cancel()
        install = self._install_task
        if install is not None and not install.done():
            # An install outliving its restore is kept: admission reopens once it finished.
            install.add_done_callback(lambda _t: self._spawn(self._reopen_if_idle(active.checkpoint_id)))
            return
        await self._open(active.checkpoint_id)

    async def _reopen_if_idle(self, checkpoint_id: str) -> None:
        async with self._lock:
            if self._active is None and not self.admission.is_open:
                await self._open(checkpoint_id)

    async def _open(self, checkpoint_id: str) -> None:
        self.admission.open()
        try:
            await self.participants.open_admission(checkpoint_id)
        except Exception as exc:
            logger.exception("open_admission hook failed after %s; the next resume retries it", checkpoint_id)
            self._reopen_failed = (checkpoint_id, exc)
        else:
            self._reopen_failed = None

    async def _retry_open(self) -> None:
        """Run a pending reopening again (under the lock); raise ``AdmissionNotReopened`` if it fails again."""
        if self._reopen_failed is None:
            return
        await self._open(self._reopen_failed[0])
        if self._reopen_failed is not None:
            checkpoint_id, exc = self._reopen_failed
            raise AdmissionNotReopened(
                f"a participant's open_admission hook failed after {checkpoint_id} "
                f"({type(exc).__name__}: {exc}); admission is still pending: resume again",
                checkpoint_id=checkpoint_id,
            )

    # -- owner -----------------------------------------------------------------------------------

    def admit_owner(self, owner: str | None, operation: str, deadline_ts: float, *, take_over: bool = False) -> None:
        """Before a control call (the routes call it): refuse another owner's call, record or extend this one's.

        A late call is ``deadline_exceeded`` first: it changes nothing, ownership included.
        """
        self._check_deadline(deadline_ts)
        self.owners.admit(
            owner, operation, deadline_ts, acquire=operation in ("prepare", "restore"), take_over=take_over
        )

    def own(self, owner: str, deadline_ts: float, *, take_over: bool = False, release: bool = False) -> dict[str, Any]:
        """The ``owner`` route: take (or renew, or take over) ownership, or release it."""
        self._check_deadline(deadline_ts)
        released = False
        if release:
            released = self.owners.release(owner)
        else:
            self.owners.admit(owner, "own", deadline_ts, acquire=True, take_over=take_over)
        return {"owner": self.owners.owner, "owner_expires_at": self.owners.expires_at, "released": released}

    # -- prepare ---------------------------------------------------------------------------------

    async def prepare(self, checkpoint_id: str, deadline_ts: float) -> dict[str, Any]:
        """Close admission and wait (until ``deadline_ts``) for readiness; see docs/protocol.md ``prepare``."""
        self._check_deadline(deadline_ts)
        async with self._lock:
            active = self._fence(checkpoint_id)
            if active is not None:
                if active.operation != "checkpoint":
                    raise InvalidPhase(f"{checkpoint_id} is a restore (phase {self.phase}); it cannot prepare")
                self.lease.extend(deadline_ts)
                if active.prepare_reply is not None:
                    return active.prepare_reply
            else:
                active = Active(checkpoint_id, "checkpoint")
                await self._begin(active, deadline_ts, Phase.PREPARING)
                try:
                    await self.participants.preparing(checkpoint_id, deadline_ts)
                except BaseException:
                    await self._back_to_idle(active)
                    raise
                active.prepare_task = self._spawn(self._await_readiness(active), active)
            task = active.prepare_task
        assert task is not None
        try:
            await self._joined(task, deadline_ts, f"prepare of {checkpoint_id}")
        except DeadlineExceeded:
            # docs/protocol.md: a prepare reaching its deadline replies 200 with its blockers; admission stays closed.
            report = await self.participants.ready(checkpoint_id)
            return {"phase": Phase.PREPARING.value, "report": report.to_wire()}
        assert active.prepare_reply is not None
        return active.prepare_reply

    async def _await_readiness(self, active: Active) -> PrepareReport:
        try:
            while True:
                report = await self.participants.ready(active.checkpoint_id)
                if report.ready:
                    break
                await self.participants.wait_ready(active.checkpoint_id)
        except Exception:
            # A prepare that raises reopens admission: phase and admission never disagree.
            async with self._lock:
                await self._back_to_idle(active)
            raise
        async with self._lock:
            if self._active is active:
                self.phase = Phase.PREPARED
                active.report = report
                active.prepare_reply = {"phase": Phase.PREPARED.value, "report": report.to_wire()}
        return report

    # -- renew and resume ------------------------------------------------------------------------

    async def renew(self, checkpoint_id: str, deadline_ts: float) -> dict[str, Any]:
        self._check_deadline(deadline_ts)
        async with self._lock:
            if self._fence(checkpoint_id) is None:
                raise InvalidPhase(f"nothing to renew: {checkpoint_id} is not active (phase {self.phase})")
            return {"lease_expires_at": self.lease.extend(deadline_ts)}

    async def resume(self, checkpoint_id: str, deadline_ts: float) -> dict[str, Any]:
        """End the active checkpoint or restore: abort its work, reopen admission, remember the id."""
        self._check_deadline(deadline_ts)
        async with self._lock:
            active = self._active
            if checkpoint_id in self._resumed or active is None:
                # Remembered all the same, so a delayed prepare for it gets stale_checkpoint.
                self._resumed.remember(checkpoint_id)
                if active is None and self._reopen_failed is not None:
                    # Not a no-op: an earlier reopening failed (e.g. a restore's rollback); retry it.
                    await self._retry_open()
                    return {"phase": self.phase.value, "idempotent": False}
                return {"phase": self.phase.value, "idempotent": True}
            if active.checkpoint_id != checkpoint_id:
                self._fence(checkpoint_id)
            self.lease.extend(deadline_ts)
            # Stop the write first: once stop() returned no manifest can appear, published or not.
            # In a thread: on an object store stop() waits for a manifest PUT under way, off the loop.
            if active.writer is not None:
                await asyncio.to_thread(active.writer.stop)
            current = asyncio.current_task()
            for task in list(active.tasks):
                if task is not current:
                    task.cancel()
            cleanup = active.cleanup_task
            if cleanup is not None and not cleanup.done():
                try:
                    await asyncio.wait_for(asyncio.shield(cleanup), self._remaining(deadline_ts))
                except TimeoutError:
                    raise DeadlineExceeded(
                        f"resume of {checkpoint_id}: restored state is still being deleted at deadline_ts "
                        f"{deadline_ts}; phase {self.phase} kept, resume again"
                    ) from None
            self._resumed.remember(checkpoint_id)
            await self._back_to_idle(active)
            if self._active is None and self._reopen_failed is not None:
                await self._retry_open()  # this resume's own reopening failed: try once more, then report it
            return {"phase": Phase.IDLE.value, "idempotent": False}

    async def _self_resume(self) -> None:
        """The lease expired: resume on our own, bounded by one retry interval."""
        checkpoint_id = self.checkpoint_id
        if checkpoint_id is None:
            self.lease.clear()
            return
        logger.warning("checkpoint lease of %s expired without a controller call; resuming", checkpoint_id)
        await self.resume(checkpoint_id, self._clock() + self.lease.policy.retry_seconds)

    # -- status and shutdown ---------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        report = await self.participants.ready(self.checkpoint_id)
        body = await self.participants.status_fields()
        body.update(
            kind=self.kind,
            instance=self.instance,
            phase=self.phase.value,
            checkpoint_id=self.checkpoint_id,
            lease_expires_at=self.lease.expires_at,
            retired_rollouts=len(self.marks),
            retired_marks=self.marks.named(RETIRED_MARKS_SHOWN),
            report=report.to_wire(),
        )
        if self.owners.owner is not None:
            # Only while owned: the status of a participant nobody owns is what it always was.
            body.update(owner=self.owners.owner, owner_expires_at=self.owners.expires_at)
        return body

    async def aclose(self) -> None:
        """Cancel every task this plane runs (server shutdown; tests)."""
        self.lease.clear()
        tasks = set(self._background)
        if self._active is not None:
            if self._active.heap is not None:
                self._active.heap.release()
            tasks |= self._active.tasks
            if self._active.cleanup_task is not None:
                tasks.add(self._active.cleanup_task)
        if self._install_task is not None:
            tasks.add(self._install_task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
