"""The environment participant: episodes that advance in steps and park at their boundaries.

docs/protocol.md "Episode steps", "Restarts" and "Retire, forget, restore marks", for any
environment server whose run logic reports its steps to an ``EpisodeBook`` (the
built-in ``single_agent_turn`` does, see ``steps.py``). The contract the
run logic follows::

    episode = book.begin(request.episode_id)        # restored boundary, if any, on episode.restored
    async with book.step(episode, "seed"):          # parks first while a checkpoint is open
        ...                                         # one step of work
    book.reach(episode, "seeded", state)            # a boundary: JSON state to continue from
    ...
    await book.park(episode)                        # the last boundary parks too
    book.end(episode)

Rules kept here:

- **Boundaries.** ``reach`` records the last completed step and the JSON state needed to
  continue after it. ``export`` writes, per episode in scope, ``{"episode_id", "boundary",
  "state", "step_mode"}``; an episode with no boundary yet is written with ``boundary:
  null`` and starts over from its input after a crash.
- **Step modes.** ``wait`` (default): a step in flight when admission closes blocks the
  checkpoint until it completes and the episode parks at its new boundary. ``replay``: it
  does not block; the episode is exported at its last boundary and the step runs again
  after a crash (effects it had downstream, e.g. model calls, repeat). A step the run logic
  marks not replayable (``step(..., replayable=False)``: a verify whose verifier did not
  declare ``/verify`` replayable) blocks in ``replay`` mode too. A step whose progress the
  server it delegates to captures (``step(..., captured=True)``: the agent step when the
  agent declared mid-turn boundaries) never blocks, in either mode; ``hand_back`` (parking
  first while a checkpoint is open) returns the rest of the step to the rules above.
- **Parking.** ``step`` and ``park`` wait while a checkpoint holds admission closed
  (``close_admission``/``open_admission``); a parked episode that wakes to a new closed
  checkpoint stays parked. While parked, the episode's deadline is paused (``deadline`` is
  the episode's ``asyncio.Timeout``; the time parked is added back).
- **Readiness** is a running set of blocking episodes, built once when admission closes
  and only shrunk by steps ending while it is closed: outside a checkpoint a step costs
  two attribute writes. ``wait_ready`` wakes on every change. Reports list at most 100
  blockers (``PrepareReport.to_wire``) with the full count beside them.
- **Restarts.** ``declare_restart`` (the resources seed replied ``x-ng-checkpoint-restart``,
  or the agent did not declare its session capturable) makes an episode a restart at once
  when no checkpoint is open, else when admission reopens, so a prepare's reported
  restarts cannot change before its commit. A restart is listed in every report, never
  blocks, never parks, is never exported (a pending one is exported with no boundary).
- **Retire.** ``retire`` drops restored-pending replacements and cancels the running
  tasks of the attempts named (and earlier ones), concurrently and at most
  ``retire_concurrency`` (256) at a time, waiting for them to end; an episode
  being retired blocks a checkpoint and is never exported. A task is cancelled once: a
  retried retire waits for the tasks an earlier one cancelled (their cleanup included,
  even after the episode left the book) and never cancels them again.
- **Retired attempts never begin.** With the control plane's marks bound
  (``bind_marks``, which the ``serving`` hook calls), ``begin`` refuses an attempt that is marked retired with
  ``StaleAttempt``: the gate refuses it first, and this check holds even for a request
  that reached the run logic past the gate.
- **An attempt runs once.** ``claim`` (the run logic calls it before Gym's lifecycle, which
  would turn any error into a terminal failure reply) refuses a second ``/run`` of an attempt
  claimed or running here with ``AttemptRunning`` (409 ``attempt_running``): that attempt lives
  elsewhere, it is no failure of the row. The claim is taken without awaiting, so two requests
  racing for one attempt cannot both pass.
- **Restore.** ``install`` validates every record (``validate_state`` from the run logic)
  before keeping any; a restored episode is handed to the ``/run`` of its replacement
  attempt by ``begin`` (``episode.Episode.restored``), and is pending until then.
- **The task is checked.** A record keeps ``task_digest``, the digest of the task its attempt
  ran (``begin(..., task=)``/``claim(..., task=)``); a replacement carrying another task is
  refused with ``TaskMismatch`` (409 ``task_mismatch``) naming the episode, and the record
  stays pending. A record without one (an earlier version's) continues whatever task.

The record and retire hooks (``export``, ``install``, ``restored_pending``, ``delete_restored``,
``retire``) are ``EpisodeRecords`` (``episode_records.py``), a base class of ``EpisodeBook``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import orjson
from nemo_gym_checkpoint_plugin.builtin_participants.environment.episode import Episode, RestoredEpisode, StepMode
from nemo_gym_checkpoint_plugin.builtin_participants.environment.episode_records import EpisodeRecords

from nemo_gym_checkpoint_plugin._admission import RetiredMarks
from nemo_gym_checkpoint_plugin._errors import AttemptRunning, StaleAttempt, TaskMismatch
from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._markers import hookimpl
from nemo_gym_checkpoint_plugin._types import Readiness

__all__ = ["Episode", "EpisodeBook", "RestoredEpisode", "StepMode", "task_digest"]


class EpisodeBook(EpisodeRecords):
    """The environment participant plugin (register it on the server's plugin manager).

    ``validate_state(boundary, state)`` is the run logic's check of a restored record: it
    raises ``ValueError`` for a boundary or state it cannot continue from.
    """

    def __init__(
        self,
        step_mode: StepMode | str = StepMode.WAIT,
        *,
        validate_state: Callable[[str | None, Mapping[str, Any]], None] | None = None,
        episode_timeout: float | None = None,
    ) -> None:
        self.step_mode = StepMode(step_mode)
        self.episode_timeout = episode_timeout
        self._validate_state = validate_state
        self._marks: RetiredMarks | None = None
        self._episodes: dict[str, Episode] = {}
        # Capture keys of the /run requests between claim() and their end (begin() runs inside).
        self._claimed: set[str] = set()
        self._restored: dict[str, RestoredEpisode] = {}
        self._restarts: set[str] = set()
        # Tasks a retire cancelled, by capture key, until they are done (a retried retire awaits them).
        self._stopping: dict[str, asyncio.Task[Any]] = {}
        self._closed = False
        self._open = asyncio.Event()
        self._open.set()
        # Maintained only while admission is closed (built by close_admission).
        self._blocking: set[str] = set()
        self._generation = 0
        self._changed = asyncio.Event()

    def bind_marks(self, marks: RetiredMarks) -> None:
        """The control plane's retired marks: ``begin`` refuses a retired attempt from now on."""
        self._marks = marks

    @hookimpl
    def serving(self, marks: RetiredMarks) -> None:
        self.bind_marks(marks)

    # -- what the run logic calls ---------------------------------------------------------------

    def refuse_retired(self, episode_id: EpisodeId) -> None:
        """Raise ``StaleAttempt`` when ``episode_id`` is marked retired (marks bound), else nothing."""
        marks = self._marks
        if marks is not None and marks.is_retired(episode_id.rollout_id, episode_id.attempt):
            raise StaleAttempt(
                f"attempt {episode_id.attempt} of rollout {episode_id.rollout_id!r} was retired "
                f"(retired up to attempt {marks.retired_up_to(episode_id.rollout_id)}); it does not begin",
                rollout_id=episode_id.rollout_id,
                attempt=episode_id.attempt,
            )

    def claim(self, episode_id: EpisodeId, task: Any = None) -> str:
        """Claim the attempt for this request; ``AttemptRunning`` when it is claimed or running here.

        ``task`` (the request's task, a JSON value or pydantic model; None: not known) is checked
        against a restored record's task digest: ``TaskMismatch`` when it differs (``check_task``).
        Returns the capture key to ``release`` when the request ends (whatever its outcome).
        """
        key = episode_id.capture_key
        if key in self._claimed or key in self._episodes:
            raise _running(episode_id)
        self.check_task(episode_id, task)
        self._claimed.add(key)
        return key

    def check_task(self, episode_id: EpisodeId, task: Any) -> str | None:
        """Refuse (``TaskMismatch``) a replacement attempt whose task is not the one its record captured.

        Returns the task's digest (None when ``task`` is None). A restored record without a digest
        (an earlier version's, or Gym's own checkpoints) continues whatever task its replacement
        carries; a refused request leaves the restored record pending.
        """
        digest = None if task is None else task_digest(task)
        restored = self._restored.get(episode_id.capture_key)
        if restored is None or restored.task_digest is None or digest is None or digest == restored.task_digest:
            return digest
        key = episode_id.capture_key
        raise TaskMismatch(
            f"episode {key} continues checkpointed episode {restored.checkpointed.capture_key}, whose task "
            f"(digest {restored.task_digest[:12]}...) is not the task this /run carries (digest {digest[:12]}...); "
            "it does not run",
            episodes=[key],
            rollout_id=episode_id.rollout_id,
            attempt=episode_id.attempt,
        )

    def release(self, key: str) -> None:
        self._claimed.discard(key)

    def begin(self, episode_id: EpisodeId, task: Any = None) -> Episode:
        """Register the running attempt (the current task); hand it its restored boundary, if any.

        Raises ``StaleAttempt`` for a retired attempt (``refuse_retired``): the gate refuses those
        before they reach the run logic, but a request that got past the gate (a body it could not
        attribute) must not run a retired attempt either. ``task`` (the request's task, None: not
        known) must be the one a restored record captured (``TaskMismatch``); its digest is kept in
        the episode's records.
        """
        self.refuse_retired(episode_id)
        key = episode_id.capture_key
        if key in self._episodes:
            raise _running(episode_id)
        digest = self.check_task(episode_id, task)
        episode = Episode(episode_id, key, asyncio.current_task(), restored=self._restored.pop(key, None))
        episode.task_digest = digest
        if episode.restored is not None:
            episode.boundary = episode.restored.boundary
            episode.state = dict(episode.restored.state)
            if digest is None:
                episode.task_digest = episode.restored.task_digest
        self._episodes[key] = episode
        return episode

    def end(self, episode: Episode) -> None:
        """The attempt's task is done with the book (returned, failed or was cancelled)."""
        if self._episodes.get(episode.key) is episode:
            del self._episodes[episode.key]
        self._restarts.discard(episode.key)
        if episode.key in self._blocking:
            self._blocking.discard(episode.key)
            self._notify()

    @asynccontextmanager
    async def step(
        self, episode: Episode, name: str, *, replayable: bool = True, captured: bool = False
    ) -> AsyncIterator[None]:
        """Run one step: park first while a checkpoint is open, then mark the step in flight.

        ``replayable=False``: the step must not run twice, so it blocks a checkpoint whatever the step mode.
        ``captured=True``: the server it delegates to captures its progress (an agent with mid-turn
        boundaries): it never blocks; after a crash it is sent again and continues there.
        """
        await self.park(episode)
        episode.step_replayable = replayable
        episode.step_captured = captured
        episode.step = name
        try:
            yield
        finally:
            episode.step = None
            episode.step_captured = False
            if self._closed and episode.key in self._blocking and not self._blocks(episode):
                self._blocking.discard(episode.key)
                self._notify()

    async def hand_back(self, episode: Episode) -> None:
        """The delegated part of a ``captured`` step returned: park while a checkpoint is open, then the
        rest (closing the agent session, which must not run twice) blocks in either mode. Else nothing."""
        if episode.step_captured:
            await self.park(episode)
            episode.step_captured = False
            episode.step_replayable = False

    def reach(self, episode: Episode, boundary: str, state: Mapping[str, Any]) -> None:
        """Record a completed step: the boundary name and the JSON state to continue from."""
        episode.boundary = boundary
        episode.state = dict(state)

    async def park(self, episode: Episode) -> None:
        """Wait while admission is closed (not for restarts); the episode deadline pauses meanwhile."""
        if self._open.is_set() or episode.restart:
            return
        loop = asyncio.get_running_loop()
        deadline = episode.deadline
        when = deadline.when() if deadline is not None else None
        remaining = None if when is None else when - loop.time()
        if deadline is not None and when is not None:
            deadline.reschedule(None)
        episode.parked = True
        try:
            # A wake that finds a new checkpoint already closed admission parks again.
            while not self._open.is_set():
                await self._open.wait()
        finally:
            episode.parked = False
            if deadline is not None and remaining is not None and not deadline.expired():
                deadline.reschedule(loop.time() + remaining)

    def declare_restart(self, episode: Episode) -> None:
        """This episode cannot be captured: a restart now, or once the open checkpoint resumed."""
        if self._closed:
            episode.pending_restart = True
            return
        self._make_restart(episode)

    @staticmethod
    def absorb_retirement(episode: Episode) -> bool:
        """In an ``except asyncio.CancelledError`` of the attempt's own task: was it retired?

        True when the controller retired ``episode`` (its task was cancelled by ``retire``): the
        cancellation is absorbed (``uncancel``) so the handler can still answer. False for any
        other cancellation, which the caller re-raises.
        """
        if not episode.retiring:
            return False
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()
        return True

    # -- internals -------------------------------------------------------------------------------

    def _make_restart(self, episode: Episode) -> None:
        episode.restart = True
        episode.pending_restart = False
        if self._episodes.get(episode.key) is episode:
            self._restarts.add(episode.key)

    def _blocks(self, episode: Episode) -> bool:
        if episode.retiring:
            return True
        if episode.step is None or episode.restart or episode.step_captured:
            return False
        return self.step_mode is StepMode.WAIT or not episode.step_replayable

    def _notify(self) -> None:
        self._generation += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def _blockers_now(self) -> Iterable[str]:
        if self._closed:
            return self._blocking
        # Idle (a status call): computed on demand, so steps pay nothing for it.
        return [key for key, episode in self._episodes.items() if self._blocks(episode)]

    # -- participant hooks -------------------------------------------------------------------------

    @hookimpl
    def close_admission(self, checkpoint_id: str) -> None:
        self._closed = True
        self._open.clear()
        self._blocking = {key for key, episode in self._episodes.items() if self._blocks(episode)}
        self._notify()

    @hookimpl
    def open_admission(self, checkpoint_id: str) -> None:
        self._closed = False
        self._blocking = set()
        for episode in list(self._episodes.values()):
            if episode.pending_restart:
                self._make_restart(episode)
        self._open.set()
        self._notify()

    @hookimpl
    def ready(self, checkpoint_id: str | None) -> Readiness:
        blockers = list(self._blockers_now())
        parked = sum(1 for episode in self._episodes.values() if episode.parked) if self._closed else 0
        return Readiness(
            blockers=blockers,
            restarts=list(self._restarts),
            counts={
                "episodes": len(self._episodes),
                "parked": parked,
                "restored_pending": len(self._restored),
            },
        )

    @hookimpl
    def wait_ready(self, checkpoint_id: str) -> Any:
        # The generation is read now, right after the ready answer it follows: no change is missed.
        return self._wait_change(self._generation)

    async def _wait_change(self, seen: int) -> None:
        while self._generation == seen:
            await self._changed.wait()

    @hookimpl
    def status_fields(self) -> dict[str, Any]:
        # episode_keys: what a controller without its own list of /run calls (ng-checkpoint commit --all)
        # continues, restarts included; restored episodes not yet started by their replacement attempt.
        return {
            "step_mode": self.step_mode.value,
            "episodes": len(self._episodes),
            "episode_keys": sorted({*self._episodes, *self._restored}),
        }


def task_digest(task: Any) -> str:
    """The sha256 hex digest of a task: its JSON (a pydantic model's ``mode="json"`` dump), keys sorted."""
    dump = getattr(task, "model_dump", None)
    value = dump(mode="json") if callable(dump) else task
    return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _running(episode_id: EpisodeId) -> AttemptRunning:
    key = episode_id.capture_key
    return AttemptRunning(
        f"episode {key} is already running on this server: that attempt lives elsewhere (another controller's "
        "/run, or a request sent twice); this one does not run",
        episodes=[key],
        rollout_id=episode_id.rollout_id,
        attempt=episode_id.attempt,
    )
