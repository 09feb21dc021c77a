"""The eight control routes under ``/ng-control/v1/checkpoint/`` (PROTOCOL.md "Routes").

Bodies are strict (unknown fields: 422), ids match PROTOCOL's pattern and length,
``deadline_ts`` is a finite number. Every route checks ``Authorization: Bearer <token>``
in constant time before it reads the body, so without the token every answer is 401.
Refusals are the JSON bodies of ``errors.py``.
``attach(app, control_plane, token)`` is what a Gym attachment calls.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Coroutine, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool
from starlette.exceptions import HTTPException

from .control import ControlPlane
from .errors import Unauthorized, install_error_handler
from .identity import EpisodeId

__all__ = [
    "CONTROL_PREFIX",
    "CHECKPOINT_ID_PATTERN",
    "attach",
    "make_router",
    "PrepareBody",
    "RenewBody",
    "ResumeBody",
    "CommitBody",
    "RestoreBody",
    "RetireBody",
    "ForgetBody",
]

CONTROL_PREFIX = "/ng-control/v1/checkpoint"
CHECKPOINT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"

CheckpointId = Annotated[str, Field(min_length=1, max_length=128, pattern=CHECKPOINT_ID_PATTERN, strict=True)]
# strict: a string "1e9" or a bool is not a deadline; allow_inf_nan: PROTOCOL says finite.
DeadlineTs = Annotated[float, Field(strict=True, allow_inf_nan=False)]
RolloutId = Annotated[str, Field(min_length=1, strict=True)]


def _checkpoint_dir(value: str) -> str:
    # Each Gym server runs in its own working directory: a relative path would name a different
    # place on every participant. A NUL byte would fail inside the filesystem calls instead of here.
    if "\x00" in value:
        raise ValueError("checkpoint_dir must not contain a NUL character")
    if not os.path.isabs(value):
        raise ValueError("checkpoint_dir must be an absolute path")
    return value


CheckpointDir = Annotated[str, Field(min_length=1, strict=True), AfterValidator(_checkpoint_dir)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint_id: CheckpointId
    deadline_ts: DeadlineTs


class PrepareBody(_Body):
    pass


class RenewBody(_Body):
    pass


class ResumeBody(_Body):
    pass


class CommitBody(_Body):
    checkpoint_dir: CheckpointDir
    episode_ids: list[EpisodeId] | None
    stop: StrictBool = False


class RestoreBody(_Body):
    checkpoint_dir: CheckpointDir
    episode_ids: list[EpisodeId]


class RetireBody(_Body):
    episode_ids: Annotated[list[EpisodeId], Field(min_length=1)]


class ForgetBody(_Body):
    rollout_ids: Annotated[list[RolloutId], Field(min_length=1)]


def _invalid_body(errors: Sequence[Any]) -> Response:
    """422 without echoing the input: FastAPI's own handler fails (a 500) on a body holding Infinity or NaN."""
    detail = [
        {"type": str(err.get("type")), "loc": [str(part) for part in err.get("loc", ())], "msg": str(err.get("msg"))}
        for err in errors
    ]
    return JSONResponse({"detail": detail}, status_code=422)


def _guarded_route_class(token: str) -> type[APIRoute]:
    expected = f"Bearer {token}".encode()

    class GuardedRoute(APIRoute):
        """Checks the token before FastAPI reads the body, so a caller without it learns nothing (always 401)."""

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def guarded(request: Request) -> Response:
                supplied = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
                # compare_digest: the time taken does not tell how much of the token was right.
                if not hmac.compare_digest(supplied, expected):
                    raise Unauthorized("missing or wrong bearer token")
                try:
                    return await handler(request)
                except RequestValidationError as exc:
                    return _invalid_body(exc.errors())
                except HTTPException as exc:
                    if exc.status_code != 400:
                        raise
                    # FastAPI's answer to a body it cannot even decode (not UTF-8): a body error like any other.
                    return _invalid_body([{"type": "json_invalid", "loc": ("body",), "msg": str(exc.detail)}])

            return guarded

    return GuardedRoute


def make_router(control: ControlPlane, token: str) -> APIRouter:
    """The control routes of ``control``, guarded by ``token`` (non-empty)."""
    if not token:
        raise ValueError("the control routes need a non-empty bearer token")
    router = APIRouter(prefix=CONTROL_PREFIX, route_class=_guarded_route_class(token))

    @router.get("/status")
    async def status() -> dict[str, Any]:
        return await control.status()

    @router.post("/prepare")
    async def prepare(body: PrepareBody) -> dict[str, Any]:
        return await control.prepare(body.checkpoint_id, body.deadline_ts)

    @router.post("/renew")
    async def renew(body: RenewBody) -> dict[str, Any]:
        return await control.renew(body.checkpoint_id, body.deadline_ts)

    @router.post("/commit")
    async def commit(body: CommitBody) -> dict[str, Any]:
        return await control.commit(body.checkpoint_id, body.deadline_ts, body.checkpoint_dir, body.episode_ids,
                                    body.stop)

    @router.post("/restore")
    async def restore(body: RestoreBody) -> dict[str, Any]:
        return await control.restore(body.checkpoint_id, body.deadline_ts, body.checkpoint_dir, body.episode_ids)

    @router.post("/resume")
    async def resume(body: ResumeBody) -> dict[str, Any]:
        return await control.resume(body.checkpoint_id, body.deadline_ts)

    @router.post("/retire")
    async def retire(body: RetireBody) -> dict[str, Any]:
        return await control.retire(body.checkpoint_id, body.deadline_ts, body.episode_ids)

    @router.post("/forget")
    async def forget(body: ForgetBody) -> dict[str, Any]:
        return await control.forget(body.checkpoint_id, body.deadline_ts, body.rollout_ids)

    return router


def attach(app: FastAPI, control: ControlPlane, token: str) -> None:
    """Serve ``control``'s routes on ``app`` with the protocol's error bodies; keep it on ``app.state``."""
    app.include_router(make_router(control, token))
    install_error_handler(app)
    app.state.checkpoint_control = control
