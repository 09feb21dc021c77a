"""Commit: export once, write through the storage backend in a thread, then clean up restored state.

Rules (PROTOCOL "Phases", "Retire, forget, restore marks", "Restarts"):

- only in ``prepared``; a scope naming a reported restart is ``restart_in_scope``;
  readiness that regressed since prepare fails the commit (``invalid_phase``);
- a checkpoint never exports twice: the first commit starts the work, a retry with the
  same directory, sorted scope and ``stop`` joins or replays it, other arguments are
  ``checkpoint_conflict``; once the export or write failed every later commit is
  ``export_failed``;
- after the write, restored-pending episodes the scope leaves out are deleted
  (``delete_restored``); a resume waits for that cleanup; with ``stop: true`` the
  participants free exported state held outside the process (failures logged).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from nemo_gym_checkpoint_plugin.errors import (
    CheckpointError,
    ExportFailed,
    InvalidPhase,
    RestartInScope,
)
from nemo_gym_checkpoint_plugin.identity import EpisodeId, from_capture_key
from nemo_gym_checkpoint_plugin.storage.executor import run_storage
from nemo_gym_checkpoint_plugin.storage.reader import capture_key_of

from .memory import Active, Replay
from .types import Phase, sorted_keys

if TYPE_CHECKING:
    from .plane import ControlPlane

__all__ = ["CommitMixin"]

logger = logging.getLogger(__name__)

# The protocol fields of a commit reply; participant extras never replace them.
_REPLY_FIELDS = ("phase", "manifest", "episode_ids")


def _scoped(records: Iterable[Mapping[str, Any]], scope: frozenset[str] | None, written: list[str]) -> Iterator[Any]:
    """Pass records inside ``scope`` to the writer, noting their capture keys (runs in the writer's thread)."""
    for record in records:
        try:
            key = capture_key_of(record["episode_id"]) if isinstance(record, Mapping) else None
        except (KeyError, ValueError) as exc:
            raise ExportFailed(f"an exported record has no valid episode_id: {exc}") from None
        if key is None:
            raise ExportFailed(f"an exported record is not a JSON object: {type(record).__name__}")
        if scope is not None and key not in scope:
            # The contract says export only what is in scope; enforce it rather than trust it.
            logger.warning("export returned %s, outside the commit scope; not written", key)
            continue
        written.append(key)
        yield record


class CommitMixin:
    async def commit(
        self: ControlPlane,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: list[EpisodeId] | None,
        stop: bool = False,
    ) -> dict[str, Any]:
        self._check_deadline(deadline_ts)
        scope = sorted_keys(episode_ids)
        args = (os.path.normpath(checkpoint_dir), scope, bool(stop))
        async with self._lock:
            active = self._fence(checkpoint_id)
            if active is None or active.operation != "checkpoint":
                raise InvalidPhase(f"commit of {checkpoint_id} needs it prepared; phase is {self.phase}")
            self.lease.extend(deadline_ts)
            if active.commit is not None:
                task = active.commit.task
                if active.export_error is not None and task.done():
                    # PROTOCOL: every later commit of the id gets export_failed, whatever its arguments.
                    raise active.export_error
                active.commit.check_args("commit", checkpoint_id, args)
            else:
                if self.phase is not Phase.PREPARED:
                    raise InvalidPhase(f"commit of {checkpoint_id} needs phase prepared; phase is {self.phase}")
                assert active.report is not None
                restarts = sorted(set(scope or ()) & set(active.report.restarts))
                if restarts:
                    raise RestartInScope(
                        f"the commit scope names {len(restarts)} episode(s) this participant reported as restarts: "
                        f"{', '.join(restarts[:10])}",
                        episodes=restarts,
                    )
                now = await self.participants.ready(checkpoint_id)
                if not now.ready:
                    raise InvalidPhase(
                        f"readiness of {checkpoint_id} regressed since prepare: {len(now.blockers)} blocker(s) "
                        f"({', '.join(now.blockers[:10])})",
                        blockers=list(now.blockers[:100]),
                    )
                task = self._spawn(self._export_and_write(active, args), active)
                active.commit = Replay(args, task)
        reply = await self._joined(task, deadline_ts, f"commit of {checkpoint_id}")
        cleanup = active.cleanup_task
        if cleanup is not None and not cleanup.done():
            # The write is durable: the commit succeeded even if cleanup outlives the deadline (resume waits).
            try:
                await asyncio.wait_for(asyncio.shield(cleanup), self._remaining(deadline_ts))
            except TimeoutError:
                logger.warning("commit of %s: restored-state cleanup still running at its deadline", checkpoint_id)
        return reply

    async def _export_and_write(self: ControlPlane, active: Active, args: tuple[Any, ...]) -> dict[str, Any]:
        checkpoint_dir, scope_keys, stop = args
        checkpoint_id = active.checkpoint_id
        scope = None if scope_keys is None else frozenset(scope_keys)
        written: list[str] = []
        try:
            exported = await self.participants.export(checkpoint_id, scope)
            writer = active.writer = self._storage.open_writer(checkpoint_dir, self.kind, self.instance, checkpoint_id)
            records = _scoped(exported.records, scope, written)
            manifest = await run_storage(writer.write, records, exported.manifest_extras)
        except asyncio.CancelledError:
            active.export_error = ExportFailed(f"the export of {checkpoint_id} was cancelled by a resume")
            raise
        except CheckpointError as exc:
            active.export_error = ExportFailed(
                f"the export of {checkpoint_id} failed ({exc.code}: {exc.detail}); the checkpoint is over",
                cause=exc.code,
            )
            raise
        except Exception as exc:
            logger.exception("export of %s failed", checkpoint_id)
            active.export_error = ExportFailed(
                f"the export of {checkpoint_id} failed ({type(exc).__name__}: {exc}); the checkpoint is over"
            )
            raise active.export_error from exc
        written.sort()
        reply: dict[str, Any] = {k: v for k, v in exported.reply_extras.items() if k not in _REPLY_FIELDS}
        reply.update(phase=Phase.COMMITTED.value, manifest=manifest, episode_ids=written)
        async with self._lock:
            if self._active is active:
                self.phase = Phase.COMMITTED
                active.cleanup_task = self._spawn(self._after_write(checkpoint_id, scope, stop, written))
        return reply

    async def _after_write(
        self: ControlPlane, checkpoint_id: str, scope: frozenset[str] | None, stop: bool, written: list[str]
    ) -> None:
        if scope is not None:
            try:
                leftover = sorted((await self.participants.restored_pending()) - scope)
                if leftover:
                    await self.participants.delete_restored([from_capture_key(key) for key in leftover])
            except Exception:
                logger.exception("commit of %s: deleting restored episodes outside its scope failed", checkpoint_id)
        if stop:
            try:
                await self.participants.release_exported(checkpoint_id, list(written))
            except Exception:
                logger.exception("commit of %s with stop: freeing exported state failed", checkpoint_id)
