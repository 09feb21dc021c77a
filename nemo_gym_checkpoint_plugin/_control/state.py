"""What every operation of one control plane shares: the phase, the active operation, and the moves between them.

``PlaneState`` holds the lock that serializes transitions, the phase, the active checkpoint or
restore, the resumed ids (fencing), the tasks running outside the lock, and admission with its
pending reopening. The operations (``plane.py``: prepare, renew, resume; ``commit.py``;
``restore.py``: restore, retire, forget) each hold it and change it only through what it
offers here, so the rules of docs/protocol.md's "Phases" (fencing, phase and admission never
disagreeing, a reopening that failed retried by the next resume) live in one place.

Methods documented "under the lock" expect the caller to hold ``lock``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from nemo_gym_checkpoint_plugin._admission import Admission, RetiredMarks
from nemo_gym_checkpoint_plugin._errors import CheckpointConflict, DeadlineExceeded, StaleCheckpoint
from nemo_gym_checkpoint_plugin._gc_pause import hold_heap
from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._telemetry import ServerTelemetry

from .._types import MAX_DEADLINE_AHEAD_SECONDS, AdmissionNotReopened, DeadlineTooFar, Phase, rollout_attempts
from .facade import Participants
from .lease import Lease
from .memory import Active, ResumedIds

__all__ = ["PlaneState"]

logger = logging.getLogger(__name__)

# Marks set between two yields to the event loop: a retire of 200,000 ids never holds data traffic long.
_MARKS_PER_YIELD = 4096


class PlaneState:
    """The shared state of one control plane and its transitions. Use from its event loop only.

    ``admission`` and ``marks`` are what the admission gate reads; ``participants`` the hooks
    the transitions call; ``lease`` is extended by every accepted call and cleared at idle.
    """

    def __init__(
        self, participants: Participants, lease: Lease, clock: Callable[[], float], telemetry: ServerTelemetry
    ) -> None:
        self.participants = participants
        self.lease = lease
        self.clock = clock
        # What the operations report (metrics, spans): docs/telemetry.md.
        self.telemetry = telemetry
        self.admission = Admission()
        self.marks = RetiredMarks()
        self.phase = Phase.IDLE
        self.lock = asyncio.Lock()
        self.active: Active | None = None
        self.resumed = ResumedIds()
        # The last restore's install, which may outlive its restore: the next one and retire wait for it.
        self.install_task: asyncio.Task[None] | None = None
        # A participant's open_admission hook that raised: (checkpoint id, error), retried by the next resume.
        self.reopen_failed: tuple[str, Exception] | None = None
        self.background: set[asyncio.Task[Any]] = set()

    @property
    def checkpoint_id(self) -> str | None:
        return None if self.active is None else self.active.checkpoint_id

    def check_deadline(self, deadline_ts: float) -> None:
        # Refused before anything changes: a late prepare does not even close admission.
        now = self.clock()
        if deadline_ts <= now:
            raise DeadlineExceeded(f"deadline_ts {deadline_ts} has already passed", deadline_ts=deadline_ts)
        if deadline_ts - now > MAX_DEADLINE_AHEAD_SECONDS:
            # A deadline in milliseconds (1.7e12) would make the lease, deadline + grace, endless.
            raise DeadlineTooFar(deadline_ts, now)

    def remaining(self, deadline_ts: float) -> float:
        return max(0.0, deadline_ts - self.clock())

    async def mark_all(self, episodes: Sequence[EpisodeId]) -> None:
        """Mark each episode retired up to its attempt (under the lock), yielding to other work in between."""
        given = rollout_attempts(episodes)
        pairs = given if isinstance(given, list) else list(given)
        for start in range(0, len(pairs), _MARKS_PER_YIELD):
            if start:
                await asyncio.sleep(0)
            self.marks.mark_many(pairs[start : start + _MARKS_PER_YIELD])

    def fence(self, checkpoint_id: str) -> Active | None:
        """The active operation if it is ``checkpoint_id``'s, ``None`` when idle; refuse a resumed or another id."""
        if checkpoint_id in self.resumed:
            raise StaleCheckpoint(f"checkpoint {checkpoint_id} was already resumed", checkpoint_id=checkpoint_id)
        active = self.active
        if active is not None and active.checkpoint_id != checkpoint_id:
            raise CheckpointConflict(
                f"{active.operation} {active.checkpoint_id} is active (phase {self.phase}); "
                f"{checkpoint_id} must wait for its resume",
                checkpoint_id=checkpoint_id,
                active=active.checkpoint_id,
            )
        return active

    def spawn[T](self, coro: Coroutine[Any, Any, T], active: Active | None = None) -> asyncio.Task[T]:
        """A task kept referenced until done; an active operation's tasks are cancelled by its resume."""
        task = asyncio.get_running_loop().create_task(coro)
        owner = active.tasks if active is not None else self.background
        owner.add(task)
        task.add_done_callback(owner.discard)
        # Errors reach callers through the shielded awaits; retrieving here keeps the loop quiet.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def joined[T](self, task: asyncio.Future[T], deadline_ts: float, what: str) -> T:
        """Await shared work within this call's deadline, without cancelling it for the others."""
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.remaining(deadline_ts))
        except TimeoutError:
            raise DeadlineExceeded(f"{what} did not finish before deadline_ts {deadline_ts}") from None
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                raise StaleCheckpoint(f"{what} was aborted by a resume") from None
            raise

    async def begin(self, active: Active, deadline_ts: float, phase: Phase) -> None:
        """Enter ``phase`` with admission closed (under the lock). A raising close hook reverts it all."""
        self.active = active
        self.phase = phase
        # No full collection of the heap inside the checkpoint or restore (_gc_pause.py); released at idle.
        active.heap = hold_heap()
        self.telemetry.admission_closing()
        self.admission.close()
        try:
            await self.participants.close_admission(active.checkpoint_id)
        except BaseException:
            await self.back_to_idle(active)
            raise
        self.lease.extend(deadline_ts)

    async def back_to_idle(self, active: Active) -> None:
        """End ``active`` (under the lock): cancel its tasks, clear the lease, reopen admission."""
        if self.active is not active:
            return
        self.active = None
        self.phase = Phase.IDLE
        self.lease.clear()
        if active.heap is not None:
            active.heap.release()
        active.cancel_tasks()
        install = self.install_task
        if install is not None and not install.done():
            # An install outliving its restore is kept: admission reopens once it finished.
            install.add_done_callback(lambda _t: self.spawn(self._reopen_if_idle(active.checkpoint_id)))
            return
        await self._open(active.checkpoint_id)

    async def _reopen_if_idle(self, checkpoint_id: str) -> None:
        async with self.lock:
            if self.active is None and not self.admission.is_open:
                await self._open(checkpoint_id)

    async def _open(self, checkpoint_id: str) -> None:
        self.admission.open()
        self.telemetry.admission_opened(checkpoint_id)
        try:
            await self.participants.open_admission(checkpoint_id)
        except Exception as exc:
            logger.exception("open_admission hook failed after %s; the next resume retries it", checkpoint_id)
            self.reopen_failed = (checkpoint_id, exc)
        else:
            self.reopen_failed = None

    async def retry_open(self) -> None:
        """Run a pending reopening again (under the lock); raise ``AdmissionNotReopened`` if it fails again."""
        if self.reopen_failed is None:
            return
        await self._open(self.reopen_failed[0])
        if self.reopen_failed is not None:
            checkpoint_id, exc = self.reopen_failed
            raise AdmissionNotReopened(
                f"a participant's open_admission hook failed after {checkpoint_id} "
                f"({type(exc).__name__}: {exc}); admission is still pending: resume again",
                checkpoint_id=checkpoint_id,
            )

    async def aclose(self) -> None:
        """Cancel every task this state runs (server shutdown; tests)."""
        self.lease.clear()
        tasks = set(self.background)
        if self.active is not None:
            if self.active.heap is not None:
                self.active.heap.release()
            tasks |= self.active.tasks
            if self.active.cleanup_task is not None:
                tasks.add(self.active.cleanup_task)
        if self.install_task is not None:
            tasks.add(self.install_task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
