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

The plane is composed, not inherited: ``state.py`` holds the shared state and the moves
between phases (the rules above), this module the checkpoint path (prepare, renew, resume,
status, owner); it holds a ``Committer`` (``commit.py``) and a ``Restorer`` (``restore.py``:
restore, retire, forget), each built on the same ``PlaneState``. Neither imports this module.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

from nemo_gym_checkpoint_plugin._admission import Admission, RetiredMarks
from nemo_gym_checkpoint_plugin._errors import DeadlineExceeded, InvalidPhase
from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._settings import CheckpointSettings
from nemo_gym_checkpoint_plugin._telemetry import ServerTelemetry

from .._types import LeasePolicy, Phase, PrepareReport
from .commit import Committer
from .facade import Participants
from .lease import Lease
from .memory import Active
from .owner import OwnerLease
from .restore import Restorer
from .state import PlaneState

if TYPE_CHECKING:
    from nemo_gym_checkpoint_plugin.api import StorageBackend

__all__ = ["ControlPlane"]

logger = logging.getLogger(__name__)

# Marks named in ``status`` (``retired_marks``); ``retired_rollouts`` counts every one.
RETIRED_MARKS_SHOWN = 100


class ControlPlane:
    """Everything one server process knows about checkpoints. Use from its event loop only.

    ``state`` (``state.py``) is what every operation shares; the plane runs prepare, renew, resume
    and status itself and hands commit to its ``Committer`` (``commit.py``), restore, retire and
    forget to its ``Restorer`` (``restore.py``), both built on the same state. ``admission`` and
    ``marks`` are the state the admission gate reads. ``storage`` and ``lease_policy`` default to
    the manager's ``storage_backend`` / ``lease_policy`` answers for ``settings``; tests inject them
    (e.g. a short ``retry_seconds``).
    """

    def __init__(
        self,
        pm: pluggy.PluginManager,
        *,
        kind: str,
        instance: str,
        settings: CheckpointSettings | None = None,
        storage: StorageBackend | None = None,
        lease_policy: LeasePolicy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from nemo_gym_checkpoint_plugin._plugins import get_storage_backend

        settings = settings or CheckpointSettings(enabled=True)
        self.kind = kind
        self.instance = instance
        self.pm = pm
        self.participants = Participants(pm)
        self.storage: StorageBackend = storage if storage is not None else get_storage_backend(pm, settings.storage)
        policy = lease_policy if lease_policy is not None else pm.hook.lease_policy(settings=settings)
        if not isinstance(policy, LeasePolicy):
            raise TypeError(f"lease_policy hook answered {policy!r}, not a LeasePolicy")
        self._clock = clock
        self.lease = Lease(policy, self._self_resume, clock)
        # One controller per deployment (owner.py): checked by the routes before each control call.
        self.owners = OwnerLease(policy, clock)
        # Only a plane builds its telemetry: with checkpointing off there is none (docs/telemetry.md).
        self.telemetry = ServerTelemetry(
            kind,
            instance,
            active_operation=lambda: None if self.state.active is None else self.state.active.operation,
            admission_open=lambda: self.admission.is_open,
            lease_expiries=lambda: self.lease.self_resumes,
            clock=clock,
        )
        self.state = PlaneState(self.participants, self.lease, clock, self.telemetry)
        self.admission: Admission = self.state.admission
        self.marks: RetiredMarks = self.state.marks
        self._commits = Committer(self.state, self.storage, kind, instance)
        self._restores = Restorer(self.state, self.storage, kind, instance)

    @property
    def phase(self) -> Phase:
        return self.state.phase

    @property
    def checkpoint_id(self) -> str | None:
        return self.state.checkpoint_id

    # -- owner -----------------------------------------------------------------------------------

    def admit_owner(self, owner: str | None, operation: str, deadline_ts: float, *, take_over: bool = False) -> None:
        """Before a control call (the routes call it): refuse another owner's call, record or extend this one's.

        A late call is ``deadline_exceeded`` first: it changes nothing, ownership included.
        """
        self.state.check_deadline(deadline_ts)
        self.owners.admit(
            owner, operation, deadline_ts, acquire=operation in ("prepare", "restore"), take_over=take_over
        )

    def own(self, owner: str, deadline_ts: float, *, take_over: bool = False, release: bool = False) -> dict[str, Any]:
        """The ``owner`` route: take (or renew, or take over) ownership, or release it."""
        self.state.check_deadline(deadline_ts)
        released = False
        if release:
            released = self.owners.release(owner)
        else:
            self.owners.admit(owner, "own", deadline_ts, acquire=True, take_over=take_over)
        return {"owner": self.owners.owner, "owner_expires_at": self.owners.expires_at, "released": released}

    # -- prepare ---------------------------------------------------------------------------------

    async def prepare(self, checkpoint_id: str, deadline_ts: float) -> dict[str, Any]:
        """Close admission and wait (until ``deadline_ts``) for readiness; see docs/protocol.md ``prepare``."""
        return await self.telemetry.call("prepare", checkpoint_id, self._prepare(checkpoint_id, deadline_ts))

    async def _prepare(self, checkpoint_id: str, deadline_ts: float) -> dict[str, Any]:
        self.state.check_deadline(deadline_ts)
        async with self.state.lock:
            active = self.state.fence(checkpoint_id)
            if active is not None:
                if active.operation != "checkpoint":
                    raise InvalidPhase(f"{checkpoint_id} is a restore (phase {self.phase}); it cannot prepare")
                self.lease.extend(deadline_ts)
                if active.prepare_reply is not None:
                    return active.prepare_reply
            else:
                active = Active(checkpoint_id, "checkpoint")
                await self.state.begin(active, deadline_ts, Phase.PREPARING)
                try:
                    await self.participants.preparing(checkpoint_id, deadline_ts)
                except BaseException:
                    await self.state.back_to_idle(active)
                    raise
                active.prepare_task = self.state.spawn(self._await_readiness(active), active)
            task = active.prepare_task
        assert task is not None
        try:
            await self.state.joined(task, deadline_ts, f"prepare of {checkpoint_id}")
        except DeadlineExceeded:
            # docs/protocol.md: a prepare reaching its deadline replies 200 with its blockers; admission stays closed.
            report = await self.participants.ready(checkpoint_id)
            return {"phase": Phase.PREPARING.value, "report": report.to_wire()}
        assert active.prepare_reply is not None
        return active.prepare_reply

    async def _await_readiness(self, active: Active) -> PrepareReport:
        try:
            with self.telemetry.stage("wait_ready", active.checkpoint_id):
                while True:
                    report = await self.participants.ready(active.checkpoint_id)
                    if report.ready:
                        break
                    await self.participants.wait_ready(active.checkpoint_id)
        except Exception:
            # A prepare that raises reopens admission: phase and admission never disagree.
            async with self.state.lock:
                await self.state.back_to_idle(active)
            raise
        async with self.state.lock:
            if self.state.active is active:
                self.state.phase = Phase.PREPARED
                active.report = report
                active.prepare_reply = {"phase": Phase.PREPARED.value, "report": report.to_wire()}
                self.telemetry.prepared(len(report.restarts))
        return report

    # -- commit, restore, retire, forget: the plane's parts ----------------------------------------

    async def commit(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: list[EpisodeId] | None,
        stop: bool = False,
    ) -> dict[str, Any]:
        """Export once and write (``commit.py``); see docs/protocol.md ``commit``."""
        work = self._commits.commit(checkpoint_id, deadline_ts, checkpoint_dir, episode_ids, stop)
        return await self.telemetry.call("commit", checkpoint_id, work)

    async def restore(
        self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str, episode_ids: list[EpisodeId]
    ) -> dict[str, Any]:
        """Mark, read and install a checkpoint's episodes (``restore.py``); see docs/protocol.md ``restore``."""
        work = self._restores.restore(checkpoint_id, deadline_ts, checkpoint_dir, episode_ids)
        return await self.telemetry.call("restore", checkpoint_id, work)

    async def retire(self, checkpoint_id: str, deadline_ts: float, episode_ids: list[EpisodeId]) -> dict[str, Any]:
        work = self._restores.retire(checkpoint_id, deadline_ts, episode_ids)
        return await self.telemetry.call("retire", checkpoint_id, work)

    async def forget(self, checkpoint_id: str, deadline_ts: float, rollout_ids: list[str]) -> dict[str, Any]:
        work = self._restores.forget(checkpoint_id, deadline_ts, rollout_ids)
        return await self.telemetry.call("forget", checkpoint_id, work)

    # -- renew and resume ------------------------------------------------------------------------

    async def renew(self, checkpoint_id: str, deadline_ts: float) -> dict[str, Any]:
        self.state.check_deadline(deadline_ts)
        async with self.state.lock:
            if self.state.fence(checkpoint_id) is None:
                raise InvalidPhase(f"nothing to renew: {checkpoint_id} is not active (phase {self.phase})")
            return {"lease_expires_at": self.lease.extend(deadline_ts)}

    async def resume(self, checkpoint_id: str, deadline_ts: float) -> dict[str, Any]:
        """End the active checkpoint or restore: abort its work, reopen admission, remember the id."""
        return await self.telemetry.call("resume", checkpoint_id, self._resume(checkpoint_id, deadline_ts))

    async def _resume(self, checkpoint_id: str, deadline_ts: float) -> dict[str, Any]:
        self.state.check_deadline(deadline_ts)
        async with self.state.lock:
            active = self.state.active
            if checkpoint_id in self.state.resumed or active is None:
                # Remembered all the same, so a delayed prepare for it gets stale_checkpoint.
                self.state.resumed.remember(checkpoint_id)
                if active is None and self.state.reopen_failed is not None:
                    # Not a no-op: an earlier reopening failed (e.g. a restore's rollback); retry it.
                    await self.state.retry_open()
                    return {"phase": self.phase.value, "idempotent": False}
                return {"phase": self.phase.value, "idempotent": True}
            if active.checkpoint_id != checkpoint_id:
                self.state.fence(checkpoint_id)
            self.lease.extend(deadline_ts)
            # Stop the write first: once stop() returned no manifest can appear, published or not.
            # In a thread: on an object store stop() waits for a manifest PUT under way, off the loop.
            if active.writer is not None:
                await asyncio.to_thread(active.writer.stop)
            active.cancel_tasks()
            cleanup = active.cleanup_task
            if cleanup is not None and not cleanup.done():
                try:
                    await asyncio.wait_for(asyncio.shield(cleanup), self.state.remaining(deadline_ts))
                except TimeoutError:
                    raise DeadlineExceeded(
                        f"resume of {checkpoint_id}: restored state is still being deleted at deadline_ts "
                        f"{deadline_ts}; phase {self.phase} kept, resume again"
                    ) from None
            self.state.resumed.remember(checkpoint_id)
            await self.state.back_to_idle(active)
            if self.state.active is None and self.state.reopen_failed is not None:
                await self.state.retry_open()  # this resume's own reopening failed: try once more, then report it
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
        body.update(self.telemetry.status_fields())  # last_checkpoint (docs/telemetry.md)
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
        await self.state.aclose()
