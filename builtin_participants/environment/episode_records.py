"""The environment participant's records and retire: what ``EpisodeBook`` writes, reads back and stops.

``EpisodeBook`` (``episode_book.py``: the run logic's side, admission and readiness) inherits these
hooks; the rules are those of its module docstring ("Boundaries", "Retire", "Restore"). Each hook
costs O(episodes named + episodes held) once: a server holds thousands of episodes at a checkpoint,
so nothing here scans the book per episode or builds an ``EpisodeId`` per held key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from nemo_gym_checkpoint_plugin.builtin_participants.environment.episode import Episode, RestoredEpisode, StepMode
from nemo_gym_checkpoint_plugin.builtin_participants.shared.attempts import (
    RETIRE_CONCURRENCY,
    RetiredBy,
    split_key,
    stop_bounded,
    stopping_until_done,
)

from nemo_gym_checkpoint_plugin._errors import AttemptRunning
from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._markers import hookimpl
from nemo_gym_checkpoint_plugin._types import ParticipantExport, RestoredRecord, Versioned

__all__ = ["EpisodeRecords"]


class EpisodeRecords:
    """Export, install, restored-pending bookkeeping and retire of an ``EpisodeBook`` (its base class)."""

    # How many retired episodes a retire stops at once (``shared.attempts.stop_bounded``).
    retire_concurrency = RETIRE_CONCURRENCY

    if TYPE_CHECKING:
        step_mode: StepMode
        _validate_state: Callable[[str | None, Mapping[str, Any]], None] | None
        _episodes: dict[str, Episode]
        _restored: dict[str, RestoredEpisode]
        _stopping: dict[str, asyncio.Task[Any]]
        _closed: bool
        _blocking: set[str]

    @hookimpl
    def export(self, checkpoint_id: str, scope: frozenset[str] | None) -> ParticipantExport:
        # Versioned: a record is built (in the writer's thread) only when the episode changed since this
        # server's previous checkpoint (``Episode.version``). Its parts are taken now: ``state`` is replaced
        # by ``reach``, never changed in place, so the dict taken here is what the record holds.
        records: list[Any] = []  # Versioned (ParticipantExport names plain records; the writer takes both)
        by_boundary: dict[str, int] = {}
        mode = self.step_mode.value
        for key, episode in self._episodes.items():
            if episode.restart or episode.retiring or (scope is not None and key not in scope):
                continue
            # A restart declared while this checkpoint was open cannot continue from its sessions.
            boundary = None if episode.pending_restart else episode.boundary
            episode_id = episode.episode_id
            rollout_id, attempt = episode_id.rollout_id, episode_id.attempt
            records.append(
                Versioned(
                    {"rollout_id": rollout_id, "attempt": attempt},
                    episode.version,
                    partial(_record, rollout_id, attempt, boundary, episode.state, mode, episode.task_digest),
                )
            )
            by_boundary[str(boundary)] = by_boundary.get(str(boundary), 0) + 1
        for key, restored in self._restored.items():
            if scope is None or key in scope:
                rollout_id, attempt = split_key(key)
                records.append(
                    Versioned(
                        {"rollout_id": rollout_id, "attempt": attempt},
                        restored.version,
                        partial(
                            _record, rollout_id, attempt, restored.boundary, restored.state, mode, restored.task_digest
                        ),
                    )
                )
                by_boundary[str(restored.boundary)] = by_boundary.get(str(restored.boundary), 0) + 1
        return ParticipantExport(
            records=records,
            manifest_extras={"step_mode": mode},
            reply_extras={"boundaries": by_boundary},
        )

    @hookimpl
    def install(self, checkpoint_id: str, manifest: Mapping[str, Any], records: list[RestoredRecord]) -> None:
        staged: dict[str, RestoredEpisode] = {}
        for restored in records:
            record = restored.record
            key = restored.replacement.capture_key
            boundary = record.get("boundary")
            state = record.get("state")
            if boundary is not None and not isinstance(boundary, str):
                raise ValueError(f"episode {restored.checkpointed.capture_key}: boundary must be a string or null")
            if type(state) is not dict and not isinstance(state, Mapping):  # decoded: a dict as a rule
                raise ValueError(f"episode {restored.checkpointed.capture_key}: state must be a JSON object")
            # Absent in a record of an earlier version (or Gym's own checkpoints): that one still restores.
            digest = record.get("task_digest")
            if digest is not None and not isinstance(digest, str):
                raise ValueError(f"episode {restored.checkpointed.capture_key}: task_digest must be a string or null")
            if self._validate_state is not None:
                try:
                    self._validate_state(boundary, state)
                except ValueError as exc:
                    raise ValueError(f"episode {restored.checkpointed.capture_key}: {exc}") from None
            if key in self._episodes:
                raise AttemptRunning(
                    f"episode {key} is already running here; it cannot be restored over", episodes=[key]
                )
            staged[key] = RestoredEpisode(restored.checkpointed, boundary, state, digest)
        # Nothing is kept unless every record was accepted.
        self._restored.update(staged)

    @hookimpl
    def restored_pending(self) -> list[str]:
        return list(self._restored)

    @hookimpl
    def delete_restored(self, episode_ids: list[EpisodeId]) -> None:
        for episode_id in episode_ids:
            self._restored.pop(episode_id.capture_key, None)

    @hookimpl
    async def retire(self, episode_ids: list[EpisodeId]) -> None:
        named = RetiredBy(episode_ids)
        for key in [k for k in self._restored if named.key(k)]:
            del self._restored[key]
        stopping = [e for e in self._episodes.values() if named(e.episode_id)]
        current = asyncio.current_task()
        for episode in stopping:
            episode.retiring = True
            if self._closed:
                self._blocking.add(episode.key)

        def stop(episode: Episode) -> bool:
            task = episode.task
            # Cancelled once: a retried retire only waits (a second cancel would interrupt its cleanup),
            # also for a task a retire running beside this one cancelled while this one waited its turn.
            if task is None or task is current or task.done() or self._stopping.get(episode.key) is task:
                return False
            task.cancel()
            stopping_until_done(self._stopping, episode.key, task)
            return True

        async def ended(episode: Episode) -> None:
            assert episode.task is not None
            await asyncio.wait([episode.task])

        # Concurrently, a bounded number at a time: each cancelled episode runs its cleanup.
        await stop_bounded(stopping, stop, ended, self.retire_concurrency)
        # Every task an earlier or this retire cancelled for these attempts, even one whose episode
        # already left the book and is still cleaning up.
        tasks = [task for key, task in self._stopping.items() if task is not current and named.key(key)]
        if tasks:
            await asyncio.wait(tasks)


def _record(
    rollout_id: str, attempt: int, boundary: str | None, state: Mapping[str, Any], mode: str, digest: str | None
) -> dict[str, Any]:
    record = {
        "episode_id": {"rollout_id": rollout_id, "attempt": attempt},
        "boundary": boundary,
        "state": dict(state) if boundary is not None else {},
        "step_mode": mode,
    }
    if digest is not None:
        # The task the attempt ran: its replacement after a crash must carry the same (environment.check_task).
        record["task_digest"] = digest
    return record
