"""``simple_agent`` run logic with mid-turn boundaries: a mixin the wrapper puts before ``SimpleAgent``.

``SimpleAgentTurns`` overrides two of ``SimpleAgent``'s methods (its file is not touched):

- ``_require_agent_session`` (``responses`` calls it with the session id of the request)
  also notes that id for the activation about to run;
- ``_create_episode`` (the turn's loop) runs the original loop with the session's ``Turn``
  active (``turn_journal.py``), as a task the retire of its attempt can cancel.

With a ``TurnBook`` bound (checkpointing enabled, ``bind_turn_book``) the server's client
becomes a ``JournaledClient`` and its module's ``http_request`` is wrapped (both behave as
before outside a session's turn). Without one the class behaves exactly as Gym's.

A turn sent again after a restore (the session's restored ``Turn``, same request digest)
continues where it stopped: the session's activation count, resources cookies and
observations are put back as they were when the turn began (so the continued turn reports
the same invocation id and observations once), and the loop replays the completed calls.
Any other request starts a new turn. A retired activation ends with 409 ``stale_attempt``.
"""

from __future__ import annotations

import asyncio
import sys
from contextvars import ContextVar
from typing import Any

from nemo_gym_checkpoint_plugin.builtin_participants.agent.turn_journal import (
    _ACTIVE,
    JournaledClient,
    Turn,
    TurnBook,
    TurnRun,
    journaled_tool_request,
    request_digest,
)

from nemo_gym_checkpoint_plugin._errors import StaleAttempt

__all__ = ["SimpleAgentTurns", "captures_mid_turn"]

# The session id of the activation the current request runs (set by _require_agent_session).
_SESSION: ContextVar[str | None] = ContextVar("ng_checkpoint_agent_session", default=None)


def captures_mid_turn(server: Any) -> bool:
    """Whether ``server`` runs Simple Agent's own turn loop under ``SimpleAgentTurns`` (so its turns are journaled)."""
    if not isinstance(server, SimpleAgentTurns):
        return False
    mro = type(server).__mro__
    owners = {
        name: next((c for c in mro if name in vars(c) and c is not SimpleAgentTurns), None)
        for name in ("_create_episode", "responses")
    }
    # A subclass that rewrote the loop or the route may call what this journal does not know.
    return all(owner is not None and owner.__name__ == "SimpleAgent" for owner in owners.values())


class SimpleAgentTurns:
    """Mixin for ``SimpleAgent`` (listed before it): journal each session turn's completed calls."""

    _ng_turn_book: TurnBook | None = None
    server_client: Any  # the agent's own (Gym's ``ServerClient``), set by ``SimpleAgent``

    def bind_turn_book(self, book: TurnBook) -> None:
        """Checkpointing is on: journal session turns in ``book`` (client and tool calls go through it)."""
        self._ng_turn_book = book
        self.server_client = JournaledClient.from_client(self.server_client)
        module = sys.modules.get(type(self).__module__)
        original = getattr(module, "http_request", None)
        if module is not None and original is not None and not hasattr(original, "__wrapped__"):
            module.http_request = journaled_tool_request(original)  # type: ignore[attr-defined]

    def _require_agent_session(self, agent_session_id: str) -> Any:
        state = super()._require_agent_session(agent_session_id)  # type: ignore[misc]
        _SESSION.set(agent_session_id)
        return state

    async def _close_agent_session_state(self, state: Any) -> Any:
        closed = await super()._close_agent_session_state(state)  # type: ignore[misc]
        if self._ng_turn_book is not None:
            self._ng_turn_book.turns.pop(state.request.agent_session_id, None)
        return closed

    async def _create_episode(self, body: Any, **kwargs: Any) -> Any:
        book = self._ng_turn_book
        session_id = _SESSION.get()
        if book is None or session_id is None or not kwargs.get("in_session"):
            return await super()._create_episode(body, **kwargs)  # type: ignore[misc]
        _SESSION.set(None)
        record = self._session_records[session_id]  # type: ignore[attr-defined]
        key = record.episode_id.capture_key
        turn = self._ng_turn(book, session_id, record.state, body, kwargs)
        token = _ACTIVE.set(TurnRun(book, key, turn))
        try:
            # Its own task (the context copied, turn included), so a retire cancels the turn alone.
            task = asyncio.ensure_future(super()._create_episode(body, **kwargs))  # type: ignore[misc]
        finally:
            _ACTIVE.reset(token)
        book.track(key, task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                task.cancel()  # the request itself was cancelled (its caller went away): so is the turn
                raise
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            raise StaleAttempt(
                f"attempt {record.episode_id.attempt} of rollout {record.episode_id.rollout_id!r} was retired "
                "while its turn ran",
                rollout_id=record.episode_id.rollout_id,
                attempt=record.episode_id.attempt,
            ) from None

    @staticmethod
    def _ng_turn(book: TurnBook, session_id: str, state: Any, body: Any, kwargs: dict[str, Any]) -> Turn:
        from nemo_gym.rollout_observability import AgentObservationBundle

        digest = request_digest(body)
        previous = book.turns.get(session_id)
        if previous is not None and previous.restored and previous.request_sha256 == digest:
            # The turn sent again after a restore: it continues from where it began, replaying its calls.
            previous.restored = False
            state.activations = previous.activation
            kwargs["invocation_id"] = "root" if previous.activation <= 1 else f"activation-{previous.activation}"
            kwargs["resources_server_cookies"] = dict(previous.cookies_before)
            raw = previous.observations_before
            state.observations = AgentObservationBundle.model_validate(raw) if raw is not None else None
            return previous
        observations = state.observations
        turn = Turn(
            activation=state.activations,
            request_sha256=digest,
            cookies_before=dict(kwargs.get("resources_server_cookies") or {}),
            observations_before=observations.model_dump(mode="json") if observations is not None else None,
        )
        book.turns[session_id] = turn
        return turn
