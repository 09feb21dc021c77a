"""``example_session_state_mgmt``'s counter, seeded the way an environment server seeds (tests only).

The wheel's ``StatefulCounterResourcesServer`` takes an Agent's legacy seed body
(``{"initial_count": n}``); ``single_agent_turn`` seeds with Gym's ``ResourcesSeedSessionRequest``.
This subclass changes only that: the initial count comes from ``task_data``. Its state, its
tools (``/increment_counter``, ``/get_counter_value``) and its ``/verify`` are the wheel's.
It also counts the tool calls it ran per rollout (``GET /_test/tool_calls``), so a test can
tell that no tool call ran twice.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from nemo_gym.base_resources_server import ResourcesSeedSessionRequest, ResourcesSeedSessionResponse
from nemo_gym.rollout_correlation import current_rollout_id
from nemo_gym.server_utils import SESSION_ID_KEY
from pydantic import PrivateAttr
from resources_servers.example_session_state_mgmt.app import (
    IncrementCounterRequest,
    IncrementCounterResponse,
    StatefulCounterResourcesServer,
)


class EnvironmentSeededCounter(StatefulCounterResourcesServer):
    _tool_calls: dict[str, int] = PrivateAttr(default_factory=dict)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.get("/_test/tool_calls")(self.tool_calls)
        return app

    async def seed_session(self, request: Request, body: ResourcesSeedSessionRequest) -> ResourcesSeedSessionResponse:
        initial = int(body.task_data.get("initial_count", 0))  # type: ignore[arg-type]
        self.session_id_to_counter.setdefault(request.session[SESSION_ID_KEY], initial)
        return ResourcesSeedSessionResponse(resources_session_id=body.resources_session_id)

    async def increment_counter(self, request: Request, body: IncrementCounterRequest) -> IncrementCounterResponse:
        key = current_rollout_id() or "unattributed"
        self._tool_calls[key] = self._tool_calls.get(key, 0) + 1
        return await super().increment_counter(request, body)

    async def tool_calls(self) -> dict[str, int]:
        return dict(self._tool_calls)


if __name__ == "__main__":
    EnvironmentSeededCounter.run_webserver()
