"""``legacy_agent`` relays as environment participants: every relayed episode is a **restart**.

Gym's ``LegacyAgentEnvironmentServer.run_legacy`` relays a ``/run`` body to an agent that
owns the whole episode inside its own ``/run`` coroutine: nothing of it can be captured at
a step boundary. ``LegacyAgentRelay`` is a mixin the wrapper puts before that class
(``wrap.derive_checkpointable``); with a book bound (checkpointing enabled) each relay is
an episode of an ``EpisodeBook`` (``episode_book.py``) declared a restart, so that
(docs/protocol.md "Restarts"):

- it is listed in every prepare report's ``restarts`` (never capped), never blocks, is
  never exported, and a commit scope naming it is refused ``restart_in_scope``;
- it keeps running through a checkpoint: the relay is not parked mid-flight (new
  ``/run`` requests park at the gate as usual);
- ``retire`` cancels the relay of the attempts named (and earlier ones) and waits for it
  to end; the relay then answers 409 ``stale_attempt``, and later ``/run`` calls of a
  retired attempt are refused ``stale_attempt`` before anything is relayed.

The episode is named by the legacy row itself (Gym's ``maybe_rollout_id_from_run_body``:
``_ng_rollout_id`` or task/rollout indices, plus ``_ng_attempt_index``), or by an
``episode_id`` object when the body carries one. A JSON object naming no episode is
agent work nobody could retire or restart: it is refused with 400
``rollout_id_required`` (docs/protocol.md "Restarts"); a body that is not a JSON object is relayed
for the agent's validation to answer. The agent's own ``/run`` lists the episode as a
restart too (``shared/uncaptured_runs.py``).

A relay that reaches the handler while a checkpoint holds admission closed (it passed the
gate just before) waits, unrelayed, for admission to reopen: it then holds nothing and is
exported with no boundary (it starts over from its input after a crash), and the restarts
a prepare reported cannot change before its commit. Without a book (checkpointing off)
the class behaves exactly as Gym's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from nemo_gym_checkpoint_plugin.builtin_participants.environment.episode_book import EpisodeBook, StepMode
from nemo_gym_checkpoint_plugin.builtin_participants.shared.uncaptured_runs import names_no_episode, rollout_id_required

from nemo_gym_checkpoint_plugin._errors import AttemptRunning, CheckpointError, StaleAttempt
from nemo_gym_checkpoint_plugin._gate import episode_of_run_body
from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._markers import hookimpl

__all__ = ["LegacyAgentRelay", "RelayBook", "relayed_episode_id", "validate_relay_state"]


def validate_relay_state(boundary: str | None, state: Mapping[str, Any]) -> None:
    """A relay has no boundaries: only a record with none (start over from the input) can be restored."""
    if boundary is not None:
        raise ValueError(f"a legacy_agent relay has no boundaries; got {boundary!r} (expected null)")


class RelayBook(EpisodeBook):
    """The participant of a ``legacy_agent`` relay server (``LegacyAgentRelay``): every relay a restart.

    Joins through ``attach`` (step mode from ``checkpoint.step_mode``); no episode deadline: the
    agent keeps its own limits.
    """

    def __init__(self, step_mode: StepMode | str = StepMode.WAIT) -> None:
        super().__init__(step_mode, validate_state=validate_relay_state)

    @hookimpl
    def attach(self, server: Any, kind: str, settings: Any) -> bool:
        if kind != "environment" or not isinstance(server, LegacyAgentRelay):
            return False
        self.step_mode = StepMode(settings.step_mode)
        server.bind_relay_book(self)
        return True


def relayed_episode_id(body: bytes) -> EpisodeId | None:
    """The episode a ``/run`` body names (its ``episode_id``, else the legacy row's identity); None if none.

    The gate attributes ``/run`` bodies the same way, so a retired attempt's row is refused
    there, before it parks during a checkpoint.
    """
    return episode_of_run_body(body)


def _error(error: CheckpointError) -> Response:
    return JSONResponse(error.to_body(), status_code=error.status)


class LegacyAgentRelay:
    """Mixin for ``LegacyAgentEnvironmentServer`` (listed before it): each relay is a restart episode."""

    _ng_relay_book: EpisodeBook | None = None

    def bind_relay_book(self, book: EpisodeBook) -> None:
        """Checkpointing is on: register every relay with ``book`` as a restart."""
        self._ng_relay_book = book

    async def run_legacy(self, request: Request) -> Response:
        book = self._ng_relay_book
        if book is None:
            return await super().run_legacy(request)  # type: ignore[misc]
        body = await request.body()
        episode_id = relayed_episode_id(body)
        if episode_id is None:
            if names_no_episode(body):
                # Agent work no one could name, retire or restart: refused rather than silently lost.
                return _error(rollout_id_required("legacy_agent relay"))
            return await super().run_legacy(request)  # type: ignore[misc]
        marks = getattr(request.app.state, "checkpoint_control", None)
        marks = getattr(marks, "marks", None)
        # The gate reads only an ``episode_id`` body; a legacy row's retired attempt is refused here.
        if marks is not None and marks.is_retired(episode_id.rollout_id, episode_id.attempt):
            return _error(_stale(episode_id, marks.retired_up_to(episode_id.rollout_id)))
        try:
            episode = book.begin(episode_id)
        except AttemptRunning as exc:
            # A second relay of an attempt being relayed: it lives elsewhere, no failure of the row.
            return _error(exc)
        try:
            # Entered while a checkpoint holds admission closed: wait unrelayed, then become a restart.
            await book.park(episode)
            book.declare_restart(episode)
            return await super().run_legacy(request)  # type: ignore[misc]
        except asyncio.CancelledError:
            if not book.absorb_retirement(episode):
                raise
            # Retired by the controller: the relay stopped; answer as the gate answers a retired attempt.
            return _error(_stale(episode_id, None))
        finally:
            book.end(episode)


def _stale(episode_id: EpisodeId, up_to: int | None) -> StaleAttempt:
    retired = "" if up_to is None else f" (retired up to attempt {up_to})"
    return StaleAttempt(
        f"attempt {episode_id.attempt} of rollout {episode_id.rollout_id!r} was retired{retired}",
        rollout_id=episode_id.rollout_id,
        attempt=episode_id.attempt,
    )
