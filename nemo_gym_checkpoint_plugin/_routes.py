"""The control routes under ``/ng-control/v1/checkpoint/`` (docs/protocol.md "Routes").

The protocol's eight, plus the plugin's ``owner`` route and ``GET metrics`` (Prometheus text,
docs/telemetry.md); every POST but ``owner`` passes the owner
lease first (``control/owner.py``: an optional ``owner`` field, ``take_over`` on prepare and restore).

Every route checks ``Authorization: Bearer <token>`` before it reads the body, so without
the token every answer is 401. The scheme is case-insensitive (RFC 7235: ``bearer``,
``BEARER``); the token is compared in constant time.

Bodies are strict (unknown fields: 422), ids match docs/protocol.md's pattern and length,
``deadline_ts`` is a finite number of seconds at most 24 hours ahead of the server's clock
(``MAX_DEADLINE_AHEAD_SECONDS``; a millisecond timestamp is refused). Limits
(``BodyLimits``, docs/protocol.md "Routes"): a body over 64 MiB is refused with 413
(from ``Content-Length`` before reading, or while it streams in), a list over 200,000 ids
with 422. Bodies are parsed with orjson (UTF-8 only) and validated in a worker thread, ids in
bulk (``control/bodies.py``), so a large body never holds the event loop. A refused body is
``{"detail": [{"type", "loc", "msg"}]}`` (422, or 413 for its size); the deadline bound is a 422
of that shape on ``deadline_ts``, like a deadline that is not a finite number: both are
malformed arguments, not protocol states. Other refusals are the JSON bodies of ``_errors.py``.
``attach(app, control_plane, token)`` is what a Gym attachment calls.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Coroutine, Sequence
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool
from starlette.exceptions import HTTPException

from ._control import ControlPlane, DeadlineTooFar
from ._control.bodies import BodyLimits, BodyRefused, ListField, parse_body, read_body
from ._errors import Unauthorized, install_error_handler
from ._identity import EpisodeId
from ._storage.objstore import is_url, normalize_url
from ._telemetry import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ._telemetry.spans import incoming as incoming_trace
from ._wire import CHECKPOINT_ID_PATTERN, CONTROL_PREFIX, OWNER_PATTERN

__all__ = [
    "BodyLimits",
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
    "OwnerBody",
]


CheckpointId = Annotated[str, Field(min_length=1, max_length=128, pattern=CHECKPOINT_ID_PATTERN, strict=True)]
OwnerId = Annotated[str, Field(min_length=1, max_length=200, pattern=OWNER_PATTERN, strict=True)]
# strict: a string "1e9" or a bool is not a deadline; allow_inf_nan: docs/protocol.md says finite.
DeadlineTs = Annotated[float, Field(strict=True, allow_inf_nan=False)]
RolloutId = Annotated[str, Field(min_length=1, strict=True)]


def _checkpoint_dir(value: str) -> str:
    # Each Gym server runs in its own working directory: a relative path would name a different
    # place on every participant. A NUL byte would fail inside the filesystem calls instead of here.
    if "\x00" in value:
        raise ValueError("checkpoint_dir must not contain a NUL character")
    if is_url(value):
        # An object store (s3://...): whether a backend writes it is the storage backend's to say.
        normalize_url(value)  # raises ValueError naming what is wrong, never repeating a credential
        return value
    if not os.path.isabs(value):
        raise ValueError("checkpoint_dir must be an absolute path or an object-store URL (s3://bucket/...)")
    return value


CheckpointDir = Annotated[str, Field(min_length=1, strict=True), AfterValidator(_checkpoint_dir)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint_id: CheckpointId
    deadline_ts: DeadlineTs
    # Optional (plugin field): the controller's owner id; a controller sending none is unchanged.
    owner: OwnerId | None = None


class PrepareBody(_Body):
    take_over: StrictBool = False


class RenewBody(_Body):
    pass


class ResumeBody(_Body):
    pass


class _DirBody(_Body):
    checkpoint_dir: CheckpointDir


class _CommitHead(_DirBody):
    stop: StrictBool = False


class CommitBody(_CommitHead):
    episode_ids: list[EpisodeId] | None


class _RestoreHead(_DirBody):
    take_over: StrictBool = False


class RestoreBody(_RestoreHead):
    episode_ids: list[EpisodeId]


class RetireBody(_Body):
    episode_ids: Annotated[list[EpisodeId], Field(min_length=1)]


class ForgetBody(_Body):
    rollout_ids: Annotated[list[RolloutId], Field(min_length=1)]


class OwnerBody(BaseModel):
    """The ``owner`` route (plugin route): take, renew, take over or release ownership of the participant."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    owner: OwnerId
    deadline_ts: DeadlineTs
    take_over: StrictBool = False
    release: StrictBool = False


# Each body: the model of its fields but the id lists (validated by pydantic), and the lists (checked in bulk).
_PARSING: dict[type[BaseModel], tuple[type[BaseModel], tuple[ListField, ...]]] = {
    PrepareBody: (PrepareBody, ()),
    RenewBody: (RenewBody, ()),
    ResumeBody: (ResumeBody, ()),
    CommitBody: (_CommitHead, (ListField("episode_ids", nullable=True),)),
    RestoreBody: (_RestoreHead, (ListField("episode_ids"),)),
    RetireBody: (_Body, (ListField("episode_ids", min_length=1, materialize=True),)),
    ForgetBody: (_Body, (ListField("rollout_ids", episodes=False, min_length=1),)),
    OwnerBody: (OwnerBody, ()),
}


_B = TypeVar("_B", bound=BaseModel)
_Owned = TypeVar("_Owned", bound=_Body)  # a body that carries the owner lease's fields


def _invalid_body(errors: Sequence[Any]) -> Response:
    """422 without echoing the input: FastAPI's own handler fails (a 500) on a body holding Infinity or NaN."""
    detail = [
        {"type": str(err.get("type")), "loc": [str(part) for part in err.get("loc", ())], "msg": str(err.get("msg"))}
        for err in errors
    ]
    return JSONResponse({"detail": detail}, status_code=422)


def _authorized(header: str, expected: bytes) -> bool:
    """``<scheme> <token>``: the scheme compared case-insensitively (RFC 7235), the token in constant time."""
    scheme, _, credentials = header.encode("utf-8", "surrogateescape").partition(b" ")
    # compare_digest: the time taken does not tell how much of the token was right.
    token_ok = hmac.compare_digest(credentials.lstrip(b" "), expected)
    return scheme.lower() == b"bearer" and token_ok


def _guarded_route_class(token: str) -> type[APIRoute]:
    expected = token.encode()

    class GuardedRoute(APIRoute):
        """Checks the token before FastAPI reads the body, so a caller without it learns nothing (always 401)."""

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def guarded(request: Request) -> Response:
                if not _authorized(request.headers.get("authorization", ""), expected):
                    raise Unauthorized("missing or wrong bearer token")
                # Under the controller's trace (its traceparent) unless Gym's server span already adopted it.
                with incoming_trace(request.headers):
                    return await answer(request)

            async def answer(request: Request) -> Response:
                try:
                    return await handler(request)
                except BodyRefused as exc:
                    return JSONResponse({"detail": exc.errors}, status_code=exc.status)
                except DeadlineTooFar as exc:
                    return _invalid_body(
                        [{"type": "deadline_too_far", "loc": ("body", "deadline_ts"), "msg": str(exc)}]
                    )
                except RequestValidationError as exc:
                    return _invalid_body(exc.errors())
                except HTTPException as exc:
                    if exc.status_code != 400:
                        raise
                    # FastAPI's answer to a body it cannot even decode (not UTF-8): a body error like any other.
                    return _invalid_body([{"type": "json_invalid", "loc": ("body",), "msg": str(exc.detail)}])

            return guarded

    return GuardedRoute


def make_router(control: ControlPlane, token: str, limits: BodyLimits | None = None) -> APIRouter:
    """The control routes of ``control``, guarded by ``token`` (non-empty), bodies within ``limits``."""
    if not token:
        raise ValueError("the control routes need a non-empty bearer token")
    limits = limits or BodyLimits()
    router = APIRouter(prefix=CONTROL_PREFIX, route_class=_guarded_route_class(token))

    async def read(request: Request, model: type[_B]) -> _B:
        head, lists = _PARSING[model]
        raw = await read_body(request, limits)
        return await parse_body(raw, model, head, lists, limits)

    @router.get("/status")
    async def status() -> dict[str, Any]:
        return await control.status()

    @router.get("/metrics")
    async def metrics() -> Response:
        # Prometheus text of this server's checkpoint metrics (docs/telemetry.md), behind the same token.
        body = await control.telemetry.scrape(lambda: control.participants.ready(control.checkpoint_id))
        return Response(body, media_type=METRICS_CONTENT_TYPE)

    async def owned(request: Request, model: type[_Owned], operation: str) -> _Owned:
        """The body, once the owner lease let the call through (control/owner.py)."""
        body = await read(request, model)
        control.admit_owner(
            body.owner,
            operation,
            body.deadline_ts,
            take_over=getattr(body, "take_over", False),
        )
        return body

    @router.post("/prepare")
    async def prepare(request: Request) -> dict[str, Any]:
        body = await owned(request, PrepareBody, "prepare")
        return await control.prepare(body.checkpoint_id, body.deadline_ts)

    @router.post("/renew")
    async def renew(request: Request) -> dict[str, Any]:
        body = await owned(request, RenewBody, "renew")
        return await control.renew(body.checkpoint_id, body.deadline_ts)

    @router.post("/commit")
    async def commit(request: Request) -> dict[str, Any]:
        body = await owned(request, CommitBody, "commit")
        return await control.commit(
            body.checkpoint_id, body.deadline_ts, body.checkpoint_dir, body.episode_ids, body.stop
        )

    @router.post("/restore")
    async def restore(request: Request) -> dict[str, Any]:
        body = await owned(request, RestoreBody, "restore")
        return await control.restore(body.checkpoint_id, body.deadline_ts, body.checkpoint_dir, body.episode_ids)

    @router.post("/resume")
    async def resume(request: Request) -> dict[str, Any]:
        body = await owned(request, ResumeBody, "resume")
        return await control.resume(body.checkpoint_id, body.deadline_ts)

    @router.post("/retire")
    async def retire(request: Request) -> dict[str, Any]:
        body = await owned(request, RetireBody, "retire")
        return await control.retire(body.checkpoint_id, body.deadline_ts, body.episode_ids)

    @router.post("/forget")
    async def forget(request: Request) -> dict[str, Any]:
        body = await owned(request, ForgetBody, "forget")
        return await control.forget(body.checkpoint_id, body.deadline_ts, body.rollout_ids)

    @router.post("/owner")
    async def owner(request: Request) -> dict[str, Any]:
        body = await read(request, OwnerBody)
        return control.own(body.owner, body.deadline_ts, take_over=body.take_over, release=body.release)

    return router


def attach(app: FastAPI, control: ControlPlane, token: str, *, limits: BodyLimits | None = None) -> None:
    """Serve ``control``'s routes on ``app`` with the protocol's error bodies; keep it on ``app.state``."""
    app.include_router(make_router(control, token, limits))
    install_error_handler(app)
    app.state.checkpoint_control = control
