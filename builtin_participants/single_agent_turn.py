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
again. The resources session is still closed by the episode's cleanup, and the agent
session too while it is open (boundary ``seeded``).

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
the admission gate.

The episode deadline (``default_episode_timeout_seconds``) moves from Gym's
``run_request`` into ``run`` (the bound book takes it over and Gym's is set to None), so
that time parked for a checkpoint is not counted. Without a book (checkpointing off) the
class behaves exactly as Gym's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

from nemo_gym.base_environment_server import CleanupContext, HandledEpisodeError
from nemo_gym.base_resources_server import ResourcesCloseSessionRequest, ResourcesSeedSessionRequest
from nemo_gym.base_responses_api_agent import (
    AgentCloseSessionRequest,
    AgentCloseSessionResponse,
    AgentSeedSessionRequest,
)
from nemo_gym.episode_types import EpisodeFailure
from nemo_gym.server_utils import get_response_json, raise_for_status
from nemo_gym.tool_access import DirectHTTPToolAccess
from nemo_gym_checkpoint_plugin.builtin_participants.environment import Episode, EpisodeBook

from nemo_gym_checkpoint_plugin import _wire as wire

__all__ = [
    "AGENT_CAPTURE_HEADER",
    "BOUNDARIES",
    "RESTART_HEADER",
    "VERIFY_HEADER",
    "SingleAgentTurnSteps",
    "validate_state",
]

RESTART_HEADER = wire.RESTART_HEADER
VERIFY_HEADER = wire.VERIFY_HEADER
AGENT_CAPTURE_HEADER = wire.AGENT_SESSION_HEADER
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


def _cookies(response: Any) -> dict[str, str]:
    return {str(name): str(getattr(morsel, "value", morsel)) for name, morsel in response.cookies.items()}


def _retryable(error: BaseException) -> bool:
    # Same classification as Gym's: transient transport errors and 408/425/429/5xx replies.
    from aiohttp import ClientConnectionError, ClientPayloadError, ClientResponseError

    if isinstance(error, ClientResponseError):
        return error.status in {408, 425, 429} or error.status >= 500
    return isinstance(error, ClientConnectionError | ClientPayloadError | TimeoutError)


@dataclass
class _Sessions:
    """The episode's session ids and cookies, read by its cleanup callbacks when they run."""

    resources_session_id: str
    agent_session_id: str
    resources_cookies: dict[str, str] = field(default_factory=dict)
    agent_cookies: dict[str, str] = field(default_factory=dict)
    agent_close: AgentCloseSessionResponse | None = None
    # The resources seed declared /verify replayable (x-ng-checkpoint-verify: replay).
    verify_replay: bool = False


class SingleAgentTurnSteps:
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
        if book is not None:
            # Before Gym's run_request, which would turn the refusal into a failure reply: a retired
            # attempt that got past the gate is answered 409 stale_attempt and never begins.
            book.refuse_retired(request.episode_id)
        return await super().run_request(request)  # type: ignore[misc]

    async def run(self, request: Any, cleanup: CleanupContext) -> Any:
        book = self._ng_episode_book
        if book is None:
            return await super().run(request, cleanup)  # type: ignore[misc]
        episode = book.begin(request.episode_id)
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
            async with book.step(episode, "agent"):
                response = await self._ng_agent(request, sessions, agent_cleanup)
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

    @staticmethod
    def _ng_seeded_state(sessions: _Sessions) -> dict[str, Any]:
        return {
            "resources_session_id": sessions.resources_session_id,
            "resources_cookies": dict(sessions.resources_cookies),
            "agent_session_id": sessions.agent_session_id,
            "agent_cookies": dict(sessions.agent_cookies),
            "verify_replay": sessions.verify_replay,
        }

    def _ng_closer(self, request: Any, sessions: _Sessions, which: str) -> Any:
        client = self.server_client  # type: ignore[attr-defined]
        config = self.config  # type: ignore[attr-defined]

        async def close_resources() -> None:
            reply = await client.post(
                server_name=config.resources_server.name,
                url_path="/close_session",
                json=ResourcesCloseSessionRequest(
                    resources_session_id=sessions.resources_session_id, episode_id=request.episode_id
                ).model_dump(mode="json"),
                cookies=sessions.resources_cookies,
            )
            await raise_for_status(reply)

        async def close_agent() -> None:
            reply = await client.post(
                server_name=config.agent_server.name,
                url_path="/v1/agent_sessions/close",
                json=AgentCloseSessionRequest(
                    agent_session_id=sessions.agent_session_id, episode_id=request.episode_id
                ).model_dump(mode="json"),
                cookies=sessions.agent_cookies,
            )
            await raise_for_status(reply)
            closed = AgentCloseSessionResponse.model_validate(await get_response_json(reply))
            if closed.agent_session_id != sessions.agent_session_id:
                raise ValueError("Agent close returned a different agent_session_id")
            sessions.agent_close = closed
            if closed.resources_cookies is not None:
                sessions.resources_cookies = dict(closed.resources_cookies)

        return close_resources if which == "resources" else close_agent

    def _ng_fail(self, stage: str, error: BaseException, partial: Any = None) -> HandledEpisodeError:
        return self._failure(  # type: ignore[attr-defined]
            stage=stage, failure_reason=str(error), terminal=not _retryable(error), partial_response=partial
        )

    async def _ng_seed(self, book: EpisodeBook, episode: Episode, request: Any, sessions: _Sessions) -> None:
        from nemo_gym.base_resources_server import ResourcesSeedSessionResponse
        from nemo_gym.base_responses_api_agent import AgentSeedSessionResponse

        client = self.server_client  # type: ignore[attr-defined]
        config = self.config  # type: ignore[attr-defined]
        task_input = request.task.task_input
        try:
            reply = await client.post(
                server_name=config.resources_server.name,
                url_path="/seed_session",
                json=ResourcesSeedSessionRequest(
                    resources_session_id=sessions.resources_session_id,
                    episode_id=request.episode_id,
                    task_id=request.task.task_id,
                    task_data=task_input.task_data,
                ).model_dump(mode="json"),
            )
            await raise_for_status(reply)
            sessions.resources_cookies = _cookies(reply)
            if not sessions.resources_cookies:
                raise ValueError("Resources seed did not establish a session cookie")
            seed = ResourcesSeedSessionResponse.model_validate(await get_response_json(reply))
            if seed.resources_session_id != sessions.resources_session_id:
                raise ValueError("Resources seed returned a different resources_session_id")
        except Exception as error:
            raise self._ng_fail("seed", error) from error
        sessions.verify_replay = reply.headers.get(VERIFY_HEADER) == "replay"
        if reply.headers.get(RESTART_HEADER):
            book.declare_restart(episode)
        if "mcp" in config.resources_tool_transports:
            # MCP tool access is not part of this run logic's capture: such episodes always start over.
            raise self._failure(  # type: ignore[attr-defined]
                stage="seed",
                failure_reason="checkpointed single_agent_turn supports direct_http tool access only",
                terminal=True,
            )
        accesses = []
        if "direct_http" in config.resources_tool_transports:
            base_url = client._resolve_base_url(config.resources_server.name).rstrip("/")
            accesses.append(
                DirectHTTPToolAccess(
                    name=f"{config.resources_server.name}.direct_http",
                    required=True,
                    base_url=base_url,
                    cookies=sessions.resources_cookies,
                )
            )
        try:
            reply = await client.post(
                server_name=config.agent_server.name,
                url_path="/v1/agent_sessions",
                json=AgentSeedSessionRequest(
                    agent_session_id=sessions.agent_session_id,
                    episode_id=request.episode_id,
                    task_id=request.task.task_id,
                    tool_accesses=accesses,
                    sandbox_access=seed.sandbox_access,
                ).model_dump(mode="json"),
            )
            await raise_for_status(reply)
            created = AgentSeedSessionResponse.model_validate(await get_response_json(reply))
            if created.agent_session_id != sessions.agent_session_id:
                raise ValueError("Agent seed returned a different agent_session_id")
            sessions.agent_cookies = _cookies(reply)
        except Exception as error:
            raise self._ng_fail("agent", error) from error
        if reply.headers.get(AGENT_CAPTURE_HEADER) != "capture":
            book.declare_restart(episode)

    async def _ng_agent(self, request: Any, sessions: _Sessions, agent_cleanup: Any) -> Any:
        from nemo_gym.openai_utils import NeMoGymResponse

        client = self.server_client  # type: ignore[attr-defined]
        config = self.config  # type: ignore[attr-defined]
        try:
            reply = await client.post(
                server_name=config.agent_server.name,
                url_path=self._agent_responses_path(request),  # type: ignore[attr-defined]
                json=request.task.task_input.responses_create_params,
                cookies=sessions.agent_cookies,
            )
            await raise_for_status(reply)
            sessions.agent_cookies = _cookies(reply) or sessions.agent_cookies
            response = NeMoGymResponse.model_validate(await get_response_json(reply))
        except Exception as error:
            raise self._ng_fail("agent", error) from error
        try:
            # The close reply carries the agent's observations and the final resources cookies.
            await agent_cleanup.close()
        except Exception as error:
            raise self._ng_fail("cleanup", error, response) from error
        return response

    async def _ng_verify(self, request: Any, sessions: _Sessions, agent_response: Mapping[str, Any]) -> dict:
        from nemo_gym.single_agent_turn_types import SingleAgentTurnResult

        client = self.server_client  # type: ignore[attr-defined]
        config = self.config  # type: ignore[attr-defined]
        task_input = request.task.task_input
        try:
            reply = await client.post(
                server_name=config.resources_server.name,
                url_path="/verify",
                json=task_input.task_data
                | {
                    "responses_create_params": task_input.responses_create_params.model_dump(
                        mode="json", exclude_unset=True
                    ),
                    "response": dict(agent_response),
                },
                cookies=sessions.resources_cookies,
            )
            await raise_for_status(reply)
            verification = SingleAgentTurnResult.model_validate(await get_response_json(reply))
        except Exception as error:
            raise self._ng_fail("verification", error) from error
        return verification.model_dump(mode="json")

    def _ng_response(self, request: Any, state: Mapping[str, Any]) -> Any:
        from nemo_gym.single_agent_turn_types import SingleAgentTurnResponse, SingleAgentTurnResult

        result = SingleAgentTurnResult.model_validate(
            {**state["verification"], "ng_agent_observations": state.get("agent_observations")}
        )
        return SingleAgentTurnResponse(episode_id=request.episode_id, task_id=request.task.task_id, result=result)
