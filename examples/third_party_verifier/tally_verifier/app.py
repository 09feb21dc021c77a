"""``TallyResourcesServer``: a small stateful Gym resources server (one tally per seeded session).

Gym runs it from this directory (``python app.py``, or through nemo-gym-checkpoint's wrapper),
so it imports only absolute names. Its state, per Gym session id (the session cookie an
environment server keeps for the episode):

- ``/seed_session`` (Gym's ``ResourcesSeedSessionRequest``) opens a ``Tally`` for the episode:
  ``target`` and ``checkpointable`` from ``task_data``;
- ``/add`` (a tool: ``{"amount": n}``) adds to the session's tally;
- ``/verify`` rewards 1.0 when the tally equals its target (it reads, never changes, the tally);
- ``/close_session`` closes the session: its tally is dropped, and it may not be seeded again.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ResourcesCloseSessionRequest,
    ResourcesCloseSessionResponse,
    ResourcesSeedSessionRequest,
    ResourcesSeedSessionResponse,
    SimpleResourcesServer,
)
from nemo_gym.server_utils import SESSION_ID_KEY
from pydantic import BaseModel, ConfigDict, Field


class TallyConfig(BaseResourcesServerConfig):
    pass


class Tally(BaseModel):
    rollout_id: str
    attempt: int
    resources_session_id: str
    target: int
    total: int = 0
    checkpointable: bool = True


class AddRequest(BaseModel):
    amount: int


class AddResponse(BaseModel):
    total: int


class TallyVerifyRequest(BaseVerifyRequest):
    model_config = ConfigDict(extra="allow")


class TallyResourcesServer(SimpleResourcesServer):
    ray_enabled = False
    config: TallyConfig
    tallies: dict[str, Tally] = Field(default_factory=dict)  # Gym session id -> its tally
    closed: set[str] = Field(default_factory=set)  # closed resources_session_ids

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/add")(self.add)
        return app

    async def seed_session(self, request: Request, body: ResourcesSeedSessionRequest) -> ResourcesSeedSessionResponse:
        if body.resources_session_id in self.closed:
            raise ValueError(f"resources session {body.resources_session_id} is closed")
        session_id = request.session[SESSION_ID_KEY]
        self.tallies.setdefault(
            session_id,
            Tally(
                rollout_id=body.episode_id.rollout_id,
                attempt=body.episode_id.attempt,
                resources_session_id=body.resources_session_id,
                target=int(body.task_data.get("target", 0)),  # type: ignore[arg-type]
                checkpointable=body.task_data.get("checkpointable", True) is not False,
            ),
        )
        return ResourcesSeedSessionResponse(resources_session_id=body.resources_session_id)

    async def add(self, request: Request, body: AddRequest) -> AddResponse:
        tally = self.tallies.get(request.session[SESSION_ID_KEY])
        if tally is None:
            raise ValueError("no tally for this session: seed it first")
        tally.total += body.amount
        return AddResponse(total=tally.total)

    async def verify(self, request: Request, body: TallyVerifyRequest) -> BaseVerifyResponse:
        tally = self.tallies.get(request.session[SESSION_ID_KEY])
        reward = float(tally is not None and tally.total == tally.target)
        return BaseVerifyResponse(**body.model_dump(), reward=reward)

    async def close_resources_session(self, body: ResourcesCloseSessionRequest) -> ResourcesCloseSessionResponse:
        for session_id in [s for s, t in self.tallies.items() if t.resources_session_id == body.resources_session_id]:
            del self.tallies[session_id]
        self.closed.add(body.resources_session_id)
        return ResourcesCloseSessionResponse(resources_session_id=body.resources_session_id)


if __name__ == "__main__":
    TallyResourcesServer.run_webserver()
