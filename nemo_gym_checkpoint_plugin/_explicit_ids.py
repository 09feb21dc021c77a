"""An environment server decodes an explicit ``"<id>-aN"`` rollout id on Gym's typed ``/run`` itself.

Gym's typed request path (``rollout_collection._episode_request_body``) names attempt N of a
rollout the only way a row can: ``_ng_rollout_id: "<id>-aN"``, sent as ``{"episode_id":
{"rollout_id": "<id>-aN", "attempt": 0}, ...}``. Gym's ``EpisodeId`` reserves that suffix, so
the route would refuse it (422) before any run logic: NeMo RL's turn-level restore (which
resends a restored rollout as its replacement attempt) and Gym's unmodified collection could not
continue a rollout. With checkpointing on, ``ExplicitAttemptIds`` (a pure ASGI middleware on an
environment server's ``POST /run``) rewrites such a body to ``{"rollout_id": "<id>", "attempt":
N}`` before the admission gate and the route read it (docs/protocol.md "Episodes and their ids"):

- attempt 0 (or absent) beside the suffix means "no attempt index": the suffix names the attempt;
- a non-zero attempt beside it is ambiguous: refused with 422 ``ambiguous_episode_id`` before
  anything runs (``AmbiguousEpisode``);
- any other body (no suffix, not JSON, not an episode request) reaches the app byte for byte,
  whose validation answers as before.

The body is read once (the route reads it whole anyway); a plain UTF-8 body without ``-a`` in it
is handed on without being parsed. A rewritten body keeps its other fields and their order, and
gets a matching ``content-length``. Installed only when checkpointing is on (``_attach``).
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from nemo_gym_checkpoint_plugin._asgi import ASGIApp, Message, Receive, Scope, Send, buffer_body
from nemo_gym_checkpoint_plugin._errors import AmbiguousEpisode
from nemo_gym_checkpoint_plugin._gate import RUN_ATTEMPT, RUN_BODY, json_as_gym_reads, plain_run_attempt
from nemo_gym_checkpoint_plugin._identity import AmbiguousEpisodeId, episode_to_wire, make_episode_id

__all__ = ["ExplicitAttemptIds", "decode_attributed", "decode_explicit", "decode_run_body"]

_SUFFIX_MARK = b"-a"
# A UTF-8 body starts with one of these (JSON text after optional whitespace); anything else (a BOM,
# UTF-16 or UTF-32) is parsed whatever its bytes, since "-a" would not appear as these two bytes there.
_PLAIN_START = frozenset(b'{[ \t\r\n"')


def decode_run_body(body: bytes) -> bytes | None:
    """The body with its explicit ``"<id>-aN"`` decoded to attempt N of ``<id>``; None when nothing changes.

    Raises ``AmbiguousEpisode`` for a suffix together with a non-zero attempt.
    """
    if body[:1] and body[0] in _PLAIN_START and _SUFFIX_MARK not in body:
        return None
    try:
        data, strict = orjson.loads(body), True
    except ValueError:  # what orjson refuses (UTF-16/32, a BOM, NaN) Gym may still read: read it the same way
        data, strict = json_as_gym_reads(body), False
    if not isinstance(data, dict):
        return None
    episode_id = data.get("episode_id")
    if not isinstance(episode_id, dict):
        return None
    rollout_id, attempt = episode_id.get("rollout_id"), episode_id.get("attempt", 0)
    if not isinstance(rollout_id, str) or type(attempt) is not int or attempt < 0:
        return None  # the app's validation answers, as for any malformed id
    try:
        decoded = make_episode_id(rollout_id, attempt or None)
    except AmbiguousEpisodeId as exc:
        raise AmbiguousEpisode(
            f"episode_id {{'rollout_id': {rollout_id!r}, 'attempt': {attempt}}}: {exc}; send either "
            f"{{'rollout_id': {decoded_prefix(rollout_id)!r}, 'attempt': N}} or the explicit id with attempt 0",
            rollout_id=rollout_id,
            attempt=attempt,
        ) from None
    except ValueError:
        return None  # an id Gym refuses for another reason: its validation answers
    if decoded.rollout_id == rollout_id:
        return None
    data["episode_id"] = {**episode_id, **episode_to_wire(decoded)}
    return orjson.dumps(data) if strict else json.dumps(data).encode()


def decoded_prefix(rollout_id: str) -> str:
    """``<id>`` of an explicit ``"<id>-aN"`` (the id itself when it has no suffix)."""
    return make_episode_id(rollout_id).rollout_id


class ExplicitAttemptIds:
    """Pure ASGI middleware: ``POST /run`` bodies naming ``"<id>-aN"`` become attempt N of ``<id>``."""

    def __init__(self, app: ASGIApp, *, run_path: str = "/run") -> None:
        self._app = app
        self._run_path = run_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != self._run_path or scope.get("method") != "POST":
            await self._app(scope, receive, send)
            return
        decoded = await decode_explicit(scope, receive, send)
        if decoded is not None:
            await self._app(decoded[0], decoded[1], send)


async def decode_attributed(scope: Scope, receive: Receive, send: Send) -> tuple[Scope, Receive] | None:
    """``decode_explicit``, and the attempt the body names recorded for the gate (``RUN_ATTEMPT``), one parse.

    For a worker whose gate will read the attempt (retired marks present, or admission closed). The usual
    body, an exact ``{"rollout_id", "attempt"}`` that ``EpisodeId`` takes as it is, has no explicit suffix
    to decode (a reserved ``-aN`` suffix is not a plain id), so its pair is the attempt; anything else goes
    through ``decode_explicit`` and the gate's own parse, as before.
    """
    body, replay = await buffer_body(receive)
    plain = plain_run_attempt(body)
    if plain is None:
        return await _decode_buffered(scope, body, replay, receive, send)
    scope[RUN_BODY] = body
    scope[RUN_ATTEMPT] = plain
    return scope, replay


async def decode_explicit(scope: Scope, receive: Receive, send: Send) -> tuple[Scope, Receive] | None:
    """One ``POST /run``: the scope and ``receive`` to hand on (decoded when explicit), or None when refused.

    None: answered here with 422 ``ambiguous_episode_id``. The body is buffered once and recorded in
    the scope (``RUN_BODY``), so the gate and the claims read these bytes instead of buffering again.
    """
    body, replay = await buffer_body(receive)
    return await _decode_buffered(scope, body, replay, receive, send)


async def _decode_buffered(
    scope: Scope, body: bytes, replay: Receive, receive: Receive, send: Send
) -> tuple[Scope, Receive] | None:
    try:
        decoded = decode_run_body(body)
    except AmbiguousEpisode as exc:
        await _refuse(send, exc)
        return None
    if decoded is None:
        scope[RUN_BODY] = body
        return scope, replay
    rewritten = _with_length(scope, len(decoded))
    rewritten[RUN_BODY] = decoded
    return rewritten, _receive_once(decoded, receive)


def _with_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
    headers.append((b"content-length", str(length).encode()))
    return {**scope, "headers": headers}


def _receive_once(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _refuse(send: Send, exc: AmbiguousEpisode) -> None:
    body = orjson.dumps(exc.to_body())
    headers: list[Any] = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
