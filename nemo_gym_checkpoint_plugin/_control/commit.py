"""Commit: export once, write through the storage backend in a thread, then clean up restored state.

Rules (docs/protocol.md "Errors", "Phases", "Retire, forget, restore marks", "Restarts"):

- only in ``prepared``; a scope naming a reported restart is ``restart_in_scope``;
- readiness that regressed since prepare ends the checkpoint before anything is exported:
  ``export_failed``, and so is every later commit of the id, whatever its arguments (a
  retry once readiness recovered would commit a later cut than the other participants);
- a checkpoint never exports twice: the first commit starts the work, a retry with the
  same directory, sorted scope and ``stop`` joins or replays it, other arguments are
  ``checkpoint_conflict``; once the export failed every later commit is ``export_failed``;
- a failed **write** (the storage backend raised ``WriteFailed``: full disk, unwritable
  directory) is that error's reply and keeps the export: a retried commit with the same
  scope and ``stop``, into the same or another directory, writes the same records again
  (``KeptExport``); any other failure while writing (a record that is not JSON, the
  participant's iterator raising) ends the checkpoint like a failed export;
- a commit that reaches its deadline before the write published **stops the write** and replies
  ``deadline_exceeded``: no manifest appears after that reply (a controller giving up never leaves
  a complete-looking participant behind). When the manifest went out just as the deadline passed,
  the reply waits (``PUBLISHED_GRACE``) and says ``committed`` instead. The export is kept: a
  retry of the same commit (same scope and ``stop``) writes it again, or, when the export itself
  was still running, simply lets it write; a checkpoint never exports twice. A retry while the
  stopped write still runs awaits it (never a second write beside it); one that reaches its own
  deadline meanwhile writes nothing after its reply either;
- after the write, restored-pending episodes the scope leaves out are deleted
  (``delete_restored``); a failed deletion is logged (the reply stays ``committed``) and done
  again by a retry of the same commit, which replies the same manifest; a resume waits for that
  cleanup; with ``stop: true`` the participants free exported state held outside the process
  (failures logged).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from nemo_gym_checkpoint_plugin._errors import (
    CheckpointError,
    DeadlineExceeded,
    ExportFailed,
    InvalidPhase,
    RestartInScope,
    StaleCheckpoint,
    WriteFailed,
)
from nemo_gym_checkpoint_plugin._gc_pause import gc_paused
from nemo_gym_checkpoint_plugin._identity import EpisodeId, from_capture_key
from nemo_gym_checkpoint_plugin._storage.executor import run_storage
from nemo_gym_checkpoint_plugin._storage.location import normalize_checkpoint_dir
from nemo_gym_checkpoint_plugin._storage.reader import capture_key_of
from nemo_gym_checkpoint_plugin._telemetry.sizes import records_size

from .._types import Phase, Versioned, sorted_keys
from .memory import Active, KeptExport, Replay
from .state import PlaneState

if TYPE_CHECKING:
    from nemo_gym_checkpoint_plugin.api import StorageBackend

__all__ = ["Committer"]

logger = logging.getLogger(__name__)

# The protocol fields of a commit reply; participant extras never replace them.
_REPLY_FIELDS = ("phase", "manifest", "episode_ids")
# Seconds a commit whose manifest was published as its deadline passed waits to reply committed.
PUBLISHED_GRACE = 5.0


def _scoped(
    records: Iterable[Mapping[str, Any] | Versioned], scope: frozenset[str] | None, written: list[str]
) -> Iterator[Any]:
    """Pass records inside ``scope`` to the writer, noting their capture keys (runs in the writer's thread)."""
    for record in records:
        try:
            # A plain dict as a rule: the exact type test first (an ABC check costs more, per record).
            key: str | None
            if isinstance(record, Versioned):
                key = capture_key_of(record.episode_id)  # its record is built only if it is written
            else:
                is_object = type(record) is dict or isinstance(record, Mapping)
                key = capture_key_of(record["episode_id"]) if is_object else None
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


def _write_and_size(
    writer: Any, records: Iterable[Any], extras: Mapping[str, Any], checkpoint_dir: str, kind: str, instance: str
) -> tuple[dict[str, Any], int | None]:
    """Write (in the storage thread), then the published records file's size for the metrics (None: unknown)."""
    manifest = writer.write(records, extras)
    return manifest, records_size(checkpoint_dir, kind, instance, manifest)


def _raise(error: BaseException, cause: BaseException) -> NoReturn:
    if error is cause:
        raise error
    raise error from cause


class Committer:
    """The plane's commits: ``state`` is the plane's, ``storage`` writes this participant's checkpoints."""

    def __init__(self, state: PlaneState, storage: StorageBackend, kind: str, instance: str) -> None:
        self._state = state
        self._storage = storage
        self.kind = kind
        self.instance = instance

    async def commit(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: list[EpisodeId] | None,
        stop: bool = False,
    ) -> dict[str, Any]:
        self._state.check_deadline(deadline_ts)
        scope = sorted_keys(episode_ids)
        args = (normalize_checkpoint_dir(checkpoint_dir), scope, bool(stop))
        async with self._state.lock:
            active = self._state.fence(checkpoint_id)
            if active is None or active.operation != "checkpoint":
                raise InvalidPhase(f"commit of {checkpoint_id} needs it prepared; phase is {self._state.phase}")
            self._state.lease.extend(deadline_ts)
            previous = active.commit
            if active.export_error is not None and (previous is None or previous.task.done()):
                # docs/protocol.md: every later commit of the id gets export_failed, whatever its arguments.
                raise active.export_error
            if previous is not None and active.write_error is not None and previous.task.done():
                # The write failed (or was stopped at a deadline), the export is kept: write it again,
                # into this call's directory.
                previous.check_args("commit", checkpoint_id, args, any_dir=True)
                active.write_error = None
                active.writes_stopped = False
                task = self._state.spawn(self._write(active, args), active)
                active.commit = Replay(args, task)
            elif previous is not None and active.writes_stopped and not previous.task.done():
                previous.check_args("commit", checkpoint_id, args, any_dir=active.writer is not None)
                if active.writer is None:
                    # Stopped while it still exported: nothing was written yet, so it may write after all.
                    active.writes_stopped = False
                    task = previous.task
                else:
                    task = self._state.spawn(self._write_after(active, previous.task, args, active.stops), active)
                    active.commit = Replay(args, task)
            elif previous is not None:
                previous.check_args("commit", checkpoint_id, args)
                task = previous.task
                cleanup = active.cleanup_task
                if active.delete_failed is not None and (cleanup is None or cleanup.done()):
                    # The write is durable and its reply the same; the deletion that failed is done again.
                    active.cleanup_task = self._state.spawn(self._delete_unscoped(active, active.delete_failed))
            else:
                task = await self._start_commit(active, args)
        try:
            reply = await self._state.joined(task, deadline_ts, f"commit of {checkpoint_id}")
        except DeadlineExceeded:
            reply = await self._stop_late_write(active, task, deadline_ts)
        cleanup = active.cleanup_task
        if cleanup is not None and not cleanup.done():
            # The write is durable: the commit succeeded even if cleanup outlives the deadline (resume waits).
            try:
                await asyncio.wait_for(asyncio.shield(cleanup), self._state.remaining(deadline_ts))
            except TimeoutError:
                logger.warning("commit of %s: restored-state cleanup still running at its deadline", checkpoint_id)
        return reply

    async def _stop_late_write(self, active: Active, task: asyncio.Task[Any], deadline_ts: float) -> dict[str, Any]:
        """The deadline passed first: stop the write (no manifest after this reply), or reply the published one."""
        checkpoint_id = active.checkpoint_id
        async with self._state.lock:
            published = False
            if not task.done() and self._state.active is active:
                active.writes_stopped = True
                active.stops += 1
                if active.writer is not None:
                    published = active.writer.stop()
        if task.done() or published:
            try:
                # Published just as the deadline passed: durable, so the commit succeeded after all.
                return await asyncio.wait_for(asyncio.shield(task), PUBLISHED_GRACE)
            except TimeoutError:
                pass
        raise DeadlineExceeded(
            f"commit of {checkpoint_id} did not finish before deadline_ts {deadline_ts}; its write was stopped, "
            "so nothing is published after this reply (retry the commit to write the kept export)",
            deadline_ts=deadline_ts,
        )

    async def _write_after(
        self, active: Active, stopped: asyncio.Task[Any], args: tuple[Any, ...], stops: int
    ) -> dict[str, Any]:
        """A retry after a deadline stopped the write: wait for that write to end, then write again.

        ``stops`` is ``active.stops`` when the retry arrived: a deadline that stopped the writes since
        (this retry's own) means it replied ``deadline_exceeded``, so it writes nothing after all.
        """
        await asyncio.wait([stopped])
        async with self._state.lock:
            if stopped.cancelled():
                raise StaleCheckpoint(f"the write of {active.checkpoint_id} was aborted by a resume")
            error = stopped.exception()
            if error is None:
                return stopped.result()  # it had published before the stop reached it
            if active.write_error is None:
                raise error  # it failed for another reason: that is this commit's answer too
            if active.stops != stops:
                # This retry reached its own deadline while it waited: no manifest may appear after its
                # deadline_exceeded reply. The export stays kept for the next retry.
                raise active.write_error
            active.write_error = None
            active.writes_stopped = False
        return await self._write(active, args)

    async def _start_commit(self, active: Active, args: tuple[Any, ...]) -> asyncio.Task[Any]:
        """The first commit of ``active`` (under the lock): check phase, scope and readiness, start the export."""
        checkpoint_id, scope = active.checkpoint_id, args[1]
        if self._state.phase is not Phase.PREPARED:
            raise InvalidPhase(f"commit of {checkpoint_id} needs phase prepared; phase is {self._state.phase}")
        assert active.report is not None
        restarts = sorted(set(scope or ()) & set(active.report.restarts))
        if restarts:
            raise RestartInScope(
                f"the commit scope names {len(restarts)} episode(s) this participant reported as restarts: "
                f"{', '.join(restarts[:10])}",
                episodes=restarts,
            )
        now = await self._state.participants.ready(checkpoint_id)
        if not now.ready:
            # Final (docs/protocol.md "Errors"): a later retry would export a later cut than the other participants'.
            named = [*now.worker_blockers, *now.blockers]
            active.export_error = ExportFailed(
                f"readiness of {checkpoint_id} regressed since prepare: {len(named)} blocker(s) "
                f"({', '.join(named[:10])}); the checkpoint is over: resume it and prepare a new id",
                blockers=list(now.blockers[:100]),
            )
            raise active.export_error
        task = self._state.spawn(self._export_and_write(active, args), active)
        active.commit = Replay(args, task)
        return task

    async def _export_and_write(self, active: Active, args: tuple[Any, ...]) -> dict[str, Any]:
        # Export and encoding make tens of containers per record: paused, the collector neither traverses
        # them again and again nor walks the whole heap (a server holding 8,000 rollouts: ~700 MB) in a
        # full collection while the controller waits; it collects after, when its thresholds say so.
        with gc_paused():
            return await self._export_and_write_unpaused(active, args)

    async def _export_and_write_unpaused(self, active: Active, args: tuple[Any, ...]) -> dict[str, Any]:
        checkpoint_id = active.checkpoint_id
        scope = None if args[1] is None else frozenset(args[1])
        try:
            # The export hands back an iterator: most of its records are made while the write consumes them.
            with self._state.telemetry.stage("export", checkpoint_id):
                exported = await self._state.participants.export(checkpoint_id, scope)
        except BaseException as exc:
            _raise(self._export_failed(active, exc), exc)
        written: list[str] = []
        active.kept = KeptExport(
            _scoped(exported.records, scope, written), exported.manifest_extras, exported.reply_extras
        )
        active.kept.written = written
        return await self._write(active, args)

    async def _write(self, active: Active, args: tuple[Any, ...]) -> dict[str, Any]:
        """Store the kept export into ``args``' directory; a ``WriteFailed`` keeps it for a retry."""
        checkpoint_dir, scope_keys, stop = args
        checkpoint_id = active.checkpoint_id
        kept = active.kept
        assert kept is not None
        try:
            writer = active.writer = self._storage.open_writer(checkpoint_dir, self.kind, self.instance, checkpoint_id)
            if active.writes_stopped:
                writer.stop()  # a commit already replied deadline_exceeded: this write must not publish
            records = kept.replay()
            with gc_paused(), self._state.telemetry.stage("write", checkpoint_id):
                # A retried write encodes every record again.
                manifest, size = await run_storage(
                    _write_and_size, writer, records, kept.manifest_extras, checkpoint_dir, self.kind, self.instance
                )
        except BaseException as exc:
            if isinstance(exc, WriteFailed) and kept.source_error is None:
                logger.warning("commit of %s: the write failed (%s); the export is kept", checkpoint_id, exc)
                active.write_error = exc
                raise
            if active.writes_stopped and kept.source_error is None and isinstance(exc, Exception):
                # Stopped at a commit's deadline: the export is kept for a retry, like a failed write.
                active.write_error = DeadlineExceeded(
                    f"the write of {checkpoint_id} was stopped when a commit reached its deadline; retry the commit"
                )
                raise active.write_error from exc
            # The participant's iterator failed inside the write: an export failure, whatever the writer made of it.
            _raise(self._export_failed(active, kept.source_error or exc), exc)
        # Two plugins may write records of the same episode: the reply names each episode once.
        written = sorted(set(kept.written))
        kept.release()
        scope = None if scope_keys is None else frozenset(scope_keys)
        reply: dict[str, Any] = {k: v for k, v in kept.reply_extras.items() if k not in _REPLY_FIELDS}
        reply.update(phase=Phase.COMMITTED.value, manifest=manifest, episode_ids=written)
        self._state.telemetry.published(checkpoint_id, manifest, len(written), size)
        async with self._state.lock:
            if self._state.active is active:
                self._state.phase = Phase.COMMITTED
                active.cleanup_task = self._state.spawn(self._after_write(active, scope, stop, written))
        return reply

    def _export_failed(self, active: Active, exc: BaseException) -> BaseException:
        """Note that ``active``'s export failed for good; return what this commit raises."""
        checkpoint_id = active.checkpoint_id
        if isinstance(exc, asyncio.CancelledError):
            active.export_error = ExportFailed(f"the export of {checkpoint_id} was cancelled by a resume")
            return exc
        if isinstance(exc, CheckpointError):
            active.export_error = ExportFailed(
                f"the export of {checkpoint_id} failed ({exc.code}: {exc.detail}); the checkpoint is over",
                cause=exc.code,
            )
            return exc  # this commit replies the error itself; later ones export_failed
        if not isinstance(exc, Exception):
            return exc
        logger.error("export of %s failed", checkpoint_id, exc_info=exc)
        active.export_error = ExportFailed(
            f"the export of {checkpoint_id} failed ({type(exc).__name__}: {exc}); the checkpoint is over"
        )
        return active.export_error

    async def _after_write(self, active: Active, scope: frozenset[str] | None, stop: bool, written: list[str]) -> None:
        checkpoint_id = active.checkpoint_id
        if scope is not None:
            await self._delete_unscoped(active, scope)
        if stop:
            try:
                await self._state.participants.release_exported(checkpoint_id, list(written))
            except Exception:
                logger.exception("commit of %s with stop: freeing exported state failed", checkpoint_id)

    async def _delete_unscoped(self, active: Active, scope: frozenset[str]) -> None:
        """Delete restored-pending episodes ``scope`` leaves out; a failure is logged and kept for a retry."""
        try:
            leftover = sorted((await self._state.participants.restored_pending()) - scope)
            if leftover:
                await self._state.participants.delete_restored([from_capture_key(key) for key in leftover])
        except Exception:
            logger.exception(
                "commit of %s: deleting restored episodes outside its scope failed; a retried commit deletes again",
                active.checkpoint_id,
            )
            active.delete_failed = scope
        else:
            active.delete_failed = None
