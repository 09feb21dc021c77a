"""Restore, retire and forget: the operations that set or clear retired marks.

Rules (docs/protocol.md "Retire, forget, restore marks"):

- a server that has served data requests (``Admission.served``, set by the gate) refuses a
  restore with ``invalid_phase`` before it marks or installs anything: one rule for every kind;
- restore marks every scoped episode retired up to its checkpointed attempt *before*
  any deadline-bound work, closes admission, reads and verifies the records in a
  thread, retires the checkpointed attempts it read (stop and free what a process that
  did not crash still holds of them) and installs them as the replacement attempts
  (attempt + 1). An install
  that outlives the restore's deadline is kept: a retire or the next restore waits for
  it and admission reopens only once it finished. A failed read or install reopens
  admission (the marks stay); a failed install also deletes what it may have left.
  Python's cyclic garbage collector is paused from the read until the install ended
  (``_gc_pause.py``: it took half the CPU of a large restore);
- retire marks first (which refuses data requests parked under those attempts at
  once), then (bounded by its deadline) waits for a running install, stops and frees
  the attempts, waits until those parked requests were answered, then replies
  ``retired_count``;
- forget removes marks and replies ``forgotten_count``;
- retire and forget are refused (marking nothing) while preparing, prepared or
  committed; right after a restore their id must be the restore's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nemo_gym_checkpoint_plugin._errors import (
    CheckpointConflict,
    CheckpointError,
    InvalidCheckpointState,
    InvalidPhase,
)
from nemo_gym_checkpoint_plugin._gc_pause import gc_paused, promote_to_oldest
from nemo_gym_checkpoint_plugin._identity import EpisodeId, construct_episode, episode_from_wire
from nemo_gym_checkpoint_plugin._storage.executor import run_storage
from nemo_gym_checkpoint_plugin._storage.location import normalize_checkpoint_dir

from .._types import EpisodeIds, Phase, RestoredRecord, rollout_attempts, sorted_keys
from .memory import Active, Replay
from .state import PlaneState

if TYPE_CHECKING:
    from nemo_gym_checkpoint_plugin.api import StorageBackend

__all__ = ["Restorer"]

logger = logging.getLogger(__name__)


class Restorer:
    """The plane's restore, retire and forget: ``state`` is the plane's, ``storage`` reads its checkpoints."""

    def __init__(self, state: PlaneState, storage: StorageBackend, kind: str, instance: str) -> None:
        self._state = state
        self._storage = storage
        self.kind = kind
        self.instance = instance

    # -- restore ---------------------------------------------------------------------------------

    async def restore(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: list[EpisodeId],
    ) -> dict[str, Any]:
        self._state.check_deadline(deadline_ts)
        args = (normalize_checkpoint_dir(checkpoint_dir), sorted_keys(episode_ids))
        async with self._state.lock:
            active = self._state.fence(checkpoint_id)
            if active is not None:
                if active.operation != "restore" or active.restore is None:
                    raise InvalidPhase(
                        f"{checkpoint_id} is a checkpoint (phase {self._state.phase}); it cannot restore"
                    )
                active.restore.check_args("restore", checkpoint_id, args)
                self._state.lease.extend(deadline_ts)
                task = active.restore.task
            else:
                refusal = self._state.admission.restore_refusal
                if refusal is not None:
                    raise InvalidPhase(f"restore {checkpoint_id}: {refusal}; nothing was marked or installed")
                if self._state.admission.served:
                    # One rule for every kind, before anything is marked or installed: what a server that
                    # served episodes holds (sessions, close receipts, capture files) may belong to live ones.
                    raise InvalidPhase(
                        f"restore {checkpoint_id}: this {self.kind} server has served episodes; a checkpoint is "
                        "restored into servers that have served none (fresh processes), never half way into "
                        "live ones; nothing was marked or installed"
                    )
                # Marks first: from here on the checkpointed attempts are refused, whatever happens next.
                await self._state.mark_all(episode_ids)
                active = Active(checkpoint_id, "restore")
                await self._state.begin(active, deadline_ts, Phase.RESTORED)
                # Each episode once (a scope may repeat one), in the scope's order.
                pairs = dict.fromkeys(rollout_attempts(episode_ids))
                task = self._state.spawn(self._read_and_install(active, args[0], args[1] or (), pairs), active)
                active.restore = Replay(args, task)
        return await self._state.joined(task, deadline_ts, f"restore {checkpoint_id}")

    async def _read_and_install(
        self,
        active: Active,
        checkpoint_dir: str,
        keys: tuple[str, ...],
        pairs: Mapping[tuple[str, int], None],
    ) -> dict[str, Any]:
        try:
            with gc_paused():
                with self._state.telemetry.stage("read", active.checkpoint_id):
                    restored = await run_storage(
                        self._storage.read, checkpoint_dir, self.kind, self.instance, scope=frozenset(keys)
                    )
                # Ids only for the records read (this participant's own, a fraction of a large scope): the
                # scope's pairs were validated as EpisodeId would, so a record naming one is built from it.
                records = [_restored_record(record, pairs) for record in restored.records]
                self._state.telemetry.read(len(records))
                # Before anything is retired or installed: every record's owner must be here to take it.
                self._state.participants.check_owners(records)
                # The replacement of every episode in scope, made into EpisodeIds only if a plugin reads them.
                scope = EpisodeIds([(rollout_id, attempt + 1) for rollout_id, attempt in pairs])
                previous = self._state.install_task
                if previous is not None and not previous.done():
                    # Two installs never overlap: the next restore waits for the one that outlived its deadline.
                    await asyncio.wait([previous])
                install = self._state.install_task = self._state.spawn(
                    self._install(active.checkpoint_id, restored.manifest, records, scope)
                )
                await asyncio.shield(install)
                self._state.telemetry.installed()
                promote_to_oldest()  # the installed state is long-lived: no young collection of it
        except asyncio.CancelledError:
            raise
        except BaseException:
            async with self._state.lock:
                await self._state.back_to_idle(active)
            raise
        return {
            "phase": Phase.RESTORED.value,
            "source_checkpoint_id": restored.manifest["checkpoint_id"],
            "restored": sorted({r.replacement.capture_key for r in records}),
        }

    async def _install(
        self,
        checkpoint_id: str,
        manifest: Mapping[str, Any],
        records: list[RestoredRecord],
        scope: Sequence[EpisodeId],
    ) -> None:
        try:
            with self._state.telemetry.stage("install", checkpoint_id):
                # The checkpointed attempts are retired (marked above). A process that did not crash may
                # still run or hold them: stop and free them first, so their replacements install cleanly.
                await self._state.participants.retire([r.checkpointed for r in records])
                await self._state.participants.install(checkpoint_id, manifest, records, scope)
        except BaseException as exc:
            # Never half-installed: whatever an install left behind goes before the error is reported.
            try:
                await self._state.participants.delete_restored([r.replacement for r in records])
            except Exception:
                logger.exception("restore %s: removing a failed install's state failed", checkpoint_id)
            if isinstance(exc, ValueError) and not isinstance(exc, CheckpointError):
                raise InvalidCheckpointState(f"restore {checkpoint_id}: a participant refused a record: {exc}") from exc
            raise

    # -- retire and forget -----------------------------------------------------------------------

    def _check_marks_allowed(self, operation: str, checkpoint_id: str) -> None:
        if self._state.phase in (Phase.PREPARING, Phase.PREPARED, Phase.COMMITTED):
            raise InvalidPhase(
                f"{operation} is refused in phase {self._state.phase} (checkpoint {self._state.checkpoint_id})"
            )
        if self._state.phase is Phase.RESTORED and checkpoint_id != self._state.checkpoint_id:
            raise CheckpointConflict(
                f"{operation} after restore {self._state.checkpoint_id} must name that restore, not {checkpoint_id}",
                checkpoint_id=checkpoint_id,
                active=self._state.checkpoint_id,
            )

    async def retire(self, checkpoint_id: str, deadline_ts: float, episode_ids: list[EpisodeId]) -> dict[str, Any]:
        self._state.check_deadline(deadline_ts)
        async with self._state.lock:
            self._check_marks_allowed("retire", checkpoint_id)
            await self._state.mark_all(episode_ids)
            if self._state.phase is Phase.RESTORED:
                self._state.lease.extend(deadline_ts)
        work = self._state.spawn(self._stop_and_free(list(episode_ids)))
        await self._state.joined(work, deadline_ts, f"retire {checkpoint_id}")
        return {"retired_count": len(episode_ids)}

    async def _stop_and_free(self, episode_ids: list[EpisodeId]) -> None:
        install = self._state.install_task
        if install is not None and not install.done():
            await asyncio.wait([install])
        await self._state.participants.retire(episode_ids)
        # Data requests parked under these attempts were refused when marked; reply once they left.
        await self._state.marks.parked_left(episode.rollout_id for episode in episode_ids)

    async def forget(self, checkpoint_id: str, deadline_ts: float, rollout_ids: list[str]) -> dict[str, Any]:
        self._state.check_deadline(deadline_ts)
        async with self._state.lock:
            self._check_marks_allowed("forget", checkpoint_id)
            for rollout_id in rollout_ids:
                self._state.marks.forget(rollout_id)
            await self._state.participants.forgotten(rollout_ids)
            if self._state.phase is Phase.RESTORED:
                self._state.lease.extend(deadline_ts)
        return {"forgotten_count": len(rollout_ids)}


def _replacement(checkpointed: EpisodeId) -> EpisodeId:
    # A valid EpisodeId's rollout id with a larger attempt is valid: nothing left to validate.
    return construct_episode(checkpointed.rollout_id, checkpointed.attempt + 1)


def _restored_record(record: Mapping[str, Any], pairs: Mapping[tuple[str, int], None]) -> RestoredRecord:
    """The record with its checkpointed and replacement ids, built from the scope's validated pair when it names one."""
    wire = record["episode_id"]
    if type(wire) is dict and len(wire) == 2:
        rollout_id, attempt = wire.get("rollout_id"), wire.get("attempt")
        if type(rollout_id) is str and type(attempt) is int and (rollout_id, attempt) in pairs:
            return RestoredRecord(
                checkpointed=construct_episode(rollout_id, attempt),
                replacement=construct_episode(rollout_id, attempt + 1),
                record=record,
            )
    checkpointed = episode_from_wire(wire)
    return RestoredRecord(checkpointed=checkpointed, replacement=_replacement(checkpointed), record=record)
