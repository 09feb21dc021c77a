"""What one model server knows of Gym's capture rows: the calls it owns and the attempts it restored.

The model participant (``calls.py``) keeps one ``CaptureBook`` when token capture writes Gym's
file store; ``token_capture.py`` reads and writes the rows. Ownership is what makes the capture
invariant hold across the model servers that share one capture directory (docs/protocol.md,
section 9): a server exports a row only if the call's answer started reaching its caller from
this process, or if this process installed the row.

Memory: one model call id per owned row. A commit with a scope drops the episodes outside it
that have no call running (finished, or never continued), and a retire drops the retired
attempts, so the book holds about the rows of the episodes in flight since the last checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from nemo_gym_checkpoint_plugin.builtin_participants.model.token_capture import TokenCaptures
from nemo_gym_checkpoint_plugin.builtin_participants.shared.attempts import RetiredBy, split_key
from nemo_gym_checkpoint_plugin.builtin_participants.shared.versions import stamp

from nemo_gym_checkpoint_plugin._identity import EpisodeId, episode_id
from nemo_gym_checkpoint_plugin._types import RestoredRecord

__all__ = ["CaptureBook"]

logger = logging.getLogger(__name__)

# Attempt keys (>= 1) remembered as checked, so their later calls skip the file work: bounded, since a
# forgotten key is only checked once more (the files are the truth).
_RECENT = 65_536


class _Recent:
    """A bounded set of keys, the least recently added dropped first."""

    def __init__(self, size: int = _RECENT) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._size = size

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def add(self, key: str) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self._size:
            self._keys.popitem(last=False)

    def discard(self, key: str) -> None:
        self._keys.pop(key, None)


class CaptureBook:
    """One model server's owned calls, restored attempts and started marks (used from its event loop)."""

    def __init__(self, captures: TokenCaptures) -> None:
        self.captures = captures
        self.owned: dict[str, set[str]] = {}
        # A stamp per owned attempt (shared/versions.py), new whenever the calls it owns change: part of its
        # record's version (model_records.py), with the fingerprints of its capture files.
        self.stamps: dict[str, int] = {}
        # Installed capture keys no call has used on this server yet.
        self.restored: set[str] = set()
        self._settled = _Recent()  # attempt keys with no restored row left that a call could answer again
        self._marked = _Recent()  # attempt keys whose started marker this process made (or found)
        self._background: set[asyncio.Task[Any]] = set()
        # Restores whose dead executions this server cleared, and their scopes.
        self._cleared: dict[str, Sequence[EpisodeId]] = {}

    # -- the calls ---------------------------------------------------------------------------------

    async def begin(self, key: str) -> None:
        """A call of ``key`` reached this server: an attempt >= 1 with rows is marked started (before it runs)."""
        self.restored.discard(key)
        if key in self._marked or split_key(key)[1] == 0:
            return
        try:
            await asyncio.to_thread(self.captures.mark_started, key)
        except Exception:
            # Never fails the call: without the mark, only a commit leaving this attempt out could delete its rows.
            logger.warning("token capture: could not mark attempt %s started", key, exc_info=True)
            return
        self._marked.add(key)

    async def answering(self, key: str, call_id: str | None) -> None:
        """The call's response is about to start: drop the restored rows of ``key`` it answers again."""
        if key in self._settled or split_key(key)[1] == 0:
            return
        try:
            settled = await asyncio.to_thread(self.captures.supersede, key, call_id)
        except Exception:
            # Never fails the call; Gym's rebuild then finds the call twice and masks the sample.
            logger.warning("token capture: could not check attempt %s for calls sent again", key, exc_info=True)
            return
        if settled:
            self._settled.add(key)

    def delivered(self, key: str, call_id: str | None) -> None:
        """The call's answer started reaching its caller: its row is this server's to export."""
        if call_id is not None:
            ids = self.owned.setdefault(key, set())
            if call_id not in ids:
                ids.add(call_id)
                self.stamps[key] = stamp()

    # -- export ------------------------------------------------------------------------------------

    def owned_in(self, scope: frozenset[str] | None, running: Collection[str]) -> dict[str, tuple[int, set[str]]]:
        """``{key: (its stamp, the calls it owns)}`` of the episodes in ``scope`` (all when None), copies; owned
        episodes outside it are forgotten.

        Episodes outside a scope that have no call ``running`` here have finished or are not
        continued: their ownership is of no further use.
        """
        if scope is None:
            keys = sorted(self.owned)
        else:
            keys = sorted(scope.intersection(self.owned))
            for key in [key for key in self.owned if key not in scope and key not in running]:
                self._forget(key)
        # Copies: the writer's thread reads them while the event loop goes on.
        return {key: (self.stamps[key], set(self.owned[key])) for key in keys}

    def _forget(self, key: str) -> None:
        self.owned.pop(key, None)
        self.stamps.pop(key, None)

    # -- restore -----------------------------------------------------------------------------------

    async def install(
        self,
        restore_id: str,
        records: Sequence[RestoredRecord],
        scope: Sequence[EpisodeId],
        *,
        claimed: bool = False,
    ) -> None:
        """Check every record, then write their rows under the replacement attempts (a raising install writes none).

        ``claimed``: a worker's claim of the replacements in ``scope`` (``TokenCaptures.install``), not a restore.
        """
        captures = self.captures

        def apply() -> tuple[list[Any], bool]:
            staged = [captures.stage(r.checkpointed.capture_key, r.replacement.capture_key, r.record) for r in records]
            cleared = captures.install(restore_id, scope, staged, claimed=claimed)
            return staged, cleared

        staged, cleared = await asyncio.to_thread(apply)
        for rows in staged:
            self.restored.add(rows.key)
            self.owned.setdefault(rows.key, set()).update(rows.call_ids)
            self.stamps[rows.key] = stamp()
        if cleared:
            # Kept as given (never changed once parsed): a copy would make every EpisodeId of the scope.
            self._cleared[restore_id] = scope

    def ended(self, operation_id: str) -> None:
        """A checkpoint or restore ended (admission reopened). After a restore this server cleared for, its
        marker goes and so do the attempts before each replacement: they are dead (the restore marked them
        retired), nothing reads them again. In the background, once every participant replied (the resume).
        """
        scope = self._cleared.pop(operation_id, None)
        if scope is not None:
            captures = self.captures

            def tidy() -> None:
                captures.files.forget_cleared(operation_id)
                captures.remove_continued(scope)

            self._spawn(asyncio.to_thread(tidy), "removing a restore's marker and the continued attempts")

    def pending(self) -> list[str]:
        return sorted(self.restored)

    async def delete(self, keys: Iterable[str]) -> None:
        """Delete restored attempts among ``keys`` that this server installed (the bookkeeping after the files)."""
        doomed = [key for key in keys if key in self.restored]
        if not doomed:
            return
        await asyncio.to_thread(self.captures.delete, doomed)
        for key in doomed:
            self.restored.discard(key)
            self._forget(key)

    def retired(self, episode_ids: list[EpisodeId]) -> list[EpisodeId]:
        """Forget what the retired attempts owned; the restored ones among them, for the caller to delete.

        Proportional to the retire (each named rollout's attempts up to the one named), not to the book.
        """
        if not self.owned and not self.restored:
            return []  # a fresh server (a restore retires the checkpointed attempts first): nothing to forget
        named = [
            episode_id(rollout, attempt)
            for rollout, last in RetiredBy(episode_ids).limits.items()
            for attempt in range(last + 1)
        ]
        for episode in named:
            self._forget(episode.capture_key)
        return [episode for episode in named if episode.capture_key in self.restored]

    def _spawn(self, work: Any, what: str) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)

        def done(finished: asyncio.Task[Any]) -> None:
            self._background.discard(finished)
            if not finished.cancelled() and finished.exception() is not None:
                logger.warning("token capture: %s failed", what, exc_info=finished.exception())

        task.add_done_callback(done)
