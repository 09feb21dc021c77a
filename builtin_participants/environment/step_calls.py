"""The wire calls of the ``single_agent_turn`` steps (``steps.py``): seed, agent, verify, close.

``SingleAgentTurnCalls`` is the base of ``SingleAgentTurnSteps``: each method performs the
same calls Gym's ``SingleAgentTurnEnvironmentServer.run`` makes, with the episode's
session ids and cookies kept in ``_Sessions`` so a boundary can record them. Split from
the step logic so each module keeps one responsibility.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nemo_gym.base_environment_server import HandledEpisodeError
from nemo_gym.base_resources_server import ResourcesCloseSessionRequest, ResourcesSeedSessionRequest
from nemo_gym.base_responses_api_agent import (
    AgentCloseSessionRequest,
    AgentCloseSessionResponse,
    AgentSeedSessionRequest,
)
from nemo_gym.server_utils import get_response_json, raise_for_status
from nemo_gym.tool_access import DirectHTTPToolAccess
from nemo_gym_checkpoint_plugin.builtin_participants.environment.episode_book import Episode, EpisodeBook

from nemo_gym_checkpoint_plugin._wire import (
    AGENT_SESSION_CAPTURE,
    AGENT_SESSION_HEADER,
    AGENT_SESSION_MID_TURN,
    RESTART_HEADER,
    VERIFY_HEADER,
)

__all__ = ["SingleAgentTurnCalls"]

# Values of AGENT_SESSION_HEADER under which an agent restores its sessions after a crash.
_CAPTURING = (AGENT_SESSION_CAPTURE, AGENT_SESSION_MID_TURN)


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
    # The agent declared mid-turn capture (x-ng-checkpoint-agent-session: mid-turn).
    agent_mid_turn: bool = False


class SingleAgentTurnCalls:
    """Mixin base of ``SingleAgentTurnSteps``: the wire calls of each step."""

    @staticmethod
    def _ng_seeded_state(sessions: _Sessions) -> dict[str, Any]:
        return {
            "resources_session_id": sessions.resources_session_id,
            "resources_cookies": dict(sessions.resources_cookies),
            "agent_session_id": sessions.agent_session_id,
            "agent_cookies": dict(sessions.agent_cookies),
            "verify_replay": sessions.verify_replay,
            "agent_mid_turn": sessions.agent_mid_turn,
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
        declared = reply.headers.get(AGENT_SESSION_HEADER)
        if declared not in _CAPTURING:
            book.declare_restart(episode)
        # The agent records a boundary after each of its calls: its turn in flight never blocks.
        sessions.agent_mid_turn = declared == AGENT_SESSION_MID_TURN

    async def _ng_agent(
        self, request: Any, sessions: _Sessions, agent_cleanup: Any, before_close: Callable[[], Awaitable[None]]
    ) -> Any:
        """The turn at the agent, then the agent session's close; ``before_close`` runs between the two."""
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
        await before_close()
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
