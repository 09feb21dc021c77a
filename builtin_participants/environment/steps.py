"""``single_agent_turn`` run logic that reports its steps to an ``EpisodeBook``.

Gym's ``SingleAgentTurnEnvironmentServer.run`` keeps its session ids and cookies in
coroutine locals, so nothing outside it can capture an episode. ``SingleAgentTurnSteps``
is a mixin the wrapper puts before that class (``wrap.derive_checkpointable``); with a
book bound (checkpointing enabled) its ``run`` performs the same wire calls as Gym's,
as three steps with a boundary after each:

==========  ===============================================  ==============================
step        work                                             boundary (state kept)
==========  ===============================================  ==============================
``seed``    ``/seed_session`` at resources, then             ``seeded``: resources and agent
            ``/v1/agent_sessions`` at the agent              session ids and cookies
``agent``   the agent's ``/v1/responses``, then closing      ``replied``: + the agent's
            the agent session (observations, cookies)        response and observations
``verify``  ``/verify`` at resources                         ``verified``: + the verdict
==========  ===============================================  ==============================

A restored attempt (N+1) starts at its boundary and reuses its sessions: no seed runs
again. When the agent's session reply declared ``mid-turn`` (it records a boundary after each
of its model and tool calls) the ``agent`` step is ``captured``: it never blocks a checkpoint,
and after a crash it is sent again and the agent continues the turn where it stopped; once the
turn replied, the episode parks (``hand_back``) before closing the agent session. The
resources session is still closed by the episode's cleanup, and the agent session too while
it is open (boundary ``seeded``).

The verify step is replayed (``checkpoint.step_mode: replay``) only when the resources
seed replied ``x-ng-checkpoint-verify: replay`` (its verifier declared ``/verify``
replayable); otherwise it runs as in ``wait`` mode: a checkpoint waits for it. The
declaration is kept in the episode state (``verify_replay``) so a restored episode keeps it.

An episode is a **restart** when the resources seed replies ``x-ng-checkpoint-restart``,
or when the agent's session reply does not carry ``x-ng-checkpoint-agent-session:
capture`` (the built-in agent participant sends it; an agent without it cannot restore
its session after a crash).

A retired attempt (the control plane's marks) never begins: ``run_request`` refuses it
with 409 ``stale_attempt`` before Gym's lifecycle starts, even when its ``/run`` got past
the admission gate; an attempt already running here is refused there too, with 409
``attempt_running`` (Gym would record the error as the row's terminal failure), and a restored
episode's replacement carrying another task than its checkpoint captured with 409 ``task_mismatch``.

The episode deadline (``default_episode_timeout_seconds``) moves from Gym's
``run_request`` into ``run`` (the bound book takes it over and Gym's is set to None), so
that time parked for a checkpoint is not counted. Without a book (checkpointing off) the
class behaves exactly as Gym's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any
from uuid import uuid4

from nemo_gym.base_environment_server import CleanupContext
from nemo_gym.episode_types import EpisodeFailure
from nemo_gym_checkpoint_plugin.builtin_participants.environment.episode_book import Episode, EpisodeBook, StepMode
from nemo_gym_checkpoint_plugin.builtin_participants.environment.step_calls import (
    SingleAgentTurnCalls,
    _Sessions,
)

from nemo_gym_checkpoint_plugin._markers import hookimpl

__all__ = [
    "BOUNDARIES",
    "SingleAgentTurnBook",
    "SingleAgentTurnSteps",
    "validate_state",
]

BOUNDARIES = ("seeded", "replied", "verified")
_REQUIRED_STATE = {
    "seeded": ("resources_session_id", "resources_cookies", "agent_session_id", "agent_cookies"),
    "replied": ("resources_session_id", "resources_cookies", "agent_response"),
    "verified": ("resources_session_id", "resources_cookies", "agent_response", "verification"),
}


def validate_state(boundary: str | None, state: Mapping[str, Any]) -> None:
    """Refuse (``ValueError``) a restored boundary this run logic cannot continue from."""
    if boundary is None:
        return
    if boundary not in _REQUIRED_STATE:
        raise ValueError(f"unknown boundary {boundary!r}; expected one of {list(BOUNDARIES)} or null")
    missing = [name for name in _REQUIRED_STATE[boundary] if name not in state]
    if missing:
        raise ValueError(f"boundary {boundary!r} lacks state {missing}")
    for name in ("resources_cookies", "agent_cookies"):
        if name in state and not isinstance(state[name], Mapping):
            raise ValueError(f"{name} must be a JSON object")


class SingleAgentTurnBook(EpisodeBook):
    """The participant of an environment running ``SingleAgentTurnSteps``: its episodes, step by step.

    Joins through ``attach`` (step mode from ``checkpoint.step_mode``; it takes over the episode
    deadline); the book takes the retired marks in ``serving``.
    """

    def __init__(self) -> None:
        super().__init__(validate_state=validate_state)

    @hookimpl
    def attach(self, server: Any, kind: str, settings: Any) -> bool:
        if kind != "environment" or not isinstance(server, SingleAgentTurnSteps):
            return False
        self.step_mode = StepMode(settings.step_mode)
        server.bind_episode_book(self)
        return True


class SingleAgentTurnSteps(SingleAgentTurnCalls):
    """Mixin for ``SingleAgentTurnEnvironmentServer`` (listed before it): steps, boundaries, restore."""

    _ng_episode_book: EpisodeBook | None = None

    def bind_episode_book(self, book: EpisodeBook) -> None:
        """Checkpointing is on: run through ``book``, which also takes over the episode deadline."""
        config: Any = self.config  # type: ignore[attr-defined]
        book.episode_timeout = config.default_episode_timeout_seconds
        config.default_episode_timeout_seconds = None
        self._ng_episode_book = book

    async def run_request(self, request: Any) -> Any:
        book = self._ng_episode_book
        if book is None:
            return await super().run_request(request)  # type: ignore[misc]
        # Before Gym's run_request, which would turn either refusal into a (terminal) failure reply: a
        # retired attempt that got past the gate is answered 409 stale_attempt, an attempt already
        # running here 409 attempt_running (it lives elsewhere), and neither begins.
        book.refuse_retired(request.episode_id)
        key = book.claim(request.episode_id, request.task)
        try:
            return await super().run_request(request)  # type: ignore[misc]
        finally:
            book.release(key)

    async def run(self, request: Any, cleanup: CleanupContext) -> Any:
        book = self._ng_episode_book
        if book is None:
            return await super().run(request, cleanup)  # type: ignore[misc]
        episode = book.begin(request.episode_id, request.task)
        try:
            try:
                async with asyncio.timeout(book.episode_timeout) as deadline:
                    episode.deadline = deadline
                    return await self._ng_steps(book, episode, request, cleanup)
            except TimeoutError:
                if not deadline.expired():
                    raise
                return self.failure_response(  # type: ignore[attr-defined]
                    request, EpisodeFailure(failure_reason="Episode timed out", terminal=False)
                )
            except asyncio.CancelledError:
                if not book.absorb_retirement(episode):
                    raise
                # Retired by the controller: this attempt ends with a failure reply, not a dropped connection.
                return self.failure_response(  # type: ignore[attr-defined]
                    request,
                    EpisodeFailure(
                        failure_reason=f"attempt {request.episode_id.attempt} was retired by the controller",
                        terminal=False,
                        failure_kind="cancelled",
                    ),
                )
        finally:
            book.end(episode)

    # -- the steps ---------------------------------------------------------------------------------

    async def _ng_steps(self, book: EpisodeBook, episode: Episode, request: Any, cleanup: CleanupContext) -> Any:
        state = dict(episode.state)
        boundary = episode.boundary
        sessions = _Sessions(
            resources_session_id=state.get("resources_session_id") or f"resources-session-{uuid4().hex}",
            agent_session_id=state.get("agent_session_id") or f"agent-session-{uuid4().hex}",
            resources_cookies=dict(state.get("resources_cookies") or {}),
            agent_cookies=dict(state.get("agent_cookies") or {}),
            verify_replay=state.get("verify_replay") is True,
            agent_mid_turn=state.get("agent_mid_turn") is True,
        )
        # Registered before any seed so a lost seed reply cannot hide a caller-assigned session id.
        close_resources = self._ng_closer(request, sessions, "resources")
        resources_cleanup = cleanup.register_cleanup("resources session", close_resources)
        agent_cleanup = None
        if boundary is None:
            agent_cleanup = cleanup.register_cleanup("agent session", self._ng_closer(request, sessions, "agent"))
            async with book.step(episode, "seed"):
                await self._ng_seed(book, episode, request, sessions)
            state = self._ng_seeded_state(sessions)
            book.reach(episode, "seeded", state)
        elif boundary == "seeded":
            agent_cleanup = cleanup.register_cleanup("agent session", self._ng_closer(request, sessions, "agent"))

        if boundary in (None, "seeded"):
            assert agent_cleanup is not None
            # A mid-turn agent records its own boundaries (after each model and tool call): its turn in
            # flight never blocks, and after a crash the turn is sent again and continues at the agent.
            async with book.step(episode, "agent", captured=sessions.agent_mid_turn):
                response = await self._ng_agent(request, sessions, agent_cleanup, lambda: book.hand_back(episode))
            observations = sessions.agent_close.agent_observations if sessions.agent_close is not None else None
            state = {
                **self._ng_seeded_state(sessions),
                "agent_response": response.model_dump(mode="json"),
                "agent_observations": observations.model_dump(mode="json") if observations is not None else None,
            }
            book.reach(episode, "replied", state)

        if boundary != "verified":
            # A verifier not declared replayable must not run twice: its step blocks as in wait mode.
            async with book.step(episode, "verify", replayable=sessions.verify_replay):
                verification = await self._ng_verify(request, sessions, state["agent_response"])
            state = {**state, "verification": verification}
            book.reach(episode, "verified", state)

        # The last boundary parks too: while a checkpoint is prepared no episode finishes.
        await book.park(episode)
        cleanup.register_cleanup("post-verification resources session", resources_cleanup.close)
        return self._ng_response(request, state)
