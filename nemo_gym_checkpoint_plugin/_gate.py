"""The admission gate: a pure ASGI middleware in front of a participant's data routes.

While admission is closed (a checkpoint is being taken) new data requests *park* until
resume reopens it; they are never refused, because Gym's client would just resend them.
A request attributed to a retired attempt is refused with 409 ``stale_attempt`` (the
JSON body of ``_errors.py``), before it parks and again when it wakes. A parked request
whose attempt gets marked is refused at once, without waiting for resume, and stays
refused even if the rollout is forgotten before admission reopens (it is registered in
``RetiredMarks.parking`` while parked; a retire replies only after such requests were
answered, ``RetiredMarks.parked_left``). Health routes
(``/``, ``/health*``, ``/livez``, ``/readyz``) and control routes (``/ng-control/...``)
always pass: Gym polls ``/`` and the controller must reach a closed participant.

Attribution of a request to an episode attempt:

- Gym's path prefix ``/ng-rollout/<capture key>/...`` (parsed with ``from_capture_key``).
  Gym's own middlewares (``RolloutContextMiddleware`` on resources servers, the capture
  middleware on model servers) strip that prefix by rewriting ``path`` and ``raw_path``
  in the scope, so the gate must sit *outside* them: ``install_gate`` is called after the
  server's ``setup_webserver()`` built the app. The gate never rewrites the scope, so the
  prefix still reaches Gym's middleware and routes unchanged.
- For ``POST /run`` (an environment server's episode route, or an agent's legacy ``/run``;
  ``install_gate``'s ``run_path``) the JSON body's
  ``episode_id`` ``{"rollout_id", "attempt"}``, or for a legacy row without one the
  capture key Gym derives from it (``_ng_rollout_id``, or task and rollout indices).
  The body is decoded as Gym decodes it (orjson first; what orjson refuses, such as UTF-16
  or UTF-32 JSON, a UTF-8 BOM or ``NaN``, through the stdlib's ``json.loads`` like
  Starlette), so a body Gym would run is never left unattributed.
  Only that route's body is buffered, and only when the gate has something to decide;
  the app then receives the very same ASGI messages. A body another of the plugin's
  middlewares already buffered or parsed for this request is reused (``run_body_attempt``).
  A body that is not JSON or names no valid episode is not attributed and goes to the app,
  whose validation answers (422, or 400 for a body it cannot decode):
  the gate never fails a request itself.

Cost: while admission is open and no attempt is marked retired, a request costs one
property read and one ``len`` before it is handed on (the fast path in ``__call__``), and one
attribute read for ``Admission.served``, which the first data request sets (a server that has
served episodes refuses a restore).

When checkpointing is disabled the gate is not installed at all; whether to call
``install_gate`` is the attachment's decision.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import orjson

from nemo_gym_checkpoint_plugin._admission import Admission, RetiredMarks
from nemo_gym_checkpoint_plugin._asgi import ASGIApp, Receive, Scope, Send, buffer_body
from nemo_gym_checkpoint_plugin._errors import StaleAttempt
from nemo_gym_checkpoint_plugin._identity import EpisodeId, episode_from_wire, from_capture_key, is_plain_episode
from nemo_gym_checkpoint_plugin._wire import CONTROL_PATH_PREFIX, ROLLOUT_PATH_PREFIX

__all__ = [
    "AdmissionGate",
    "GateCounters",
    "install_gate",
    "is_exempt",
    "attempt_from_path",
    "attempt_from_run_body",
    "plain_run_attempt",
    "run_body_attempt",
    "RUN_BODY",
    "episode_of_run_body",
    "json_as_gym_reads",
    "ROLLOUT_PATH_PREFIX",
    "CONTROL_PATH_PREFIX",
]


# Gym's ROLLOUT_PATH_PREFIX ("ng-rollout") as a path prefix; a key must be followed by a rest,
# exactly as Gym's stripping middlewares require, else Gym leaves the path alone and so do we.
_EXACT_EXEMPT = frozenset({"/", "/livez", "/readyz", "/ng-control"})
_KEY_START = len(ROLLOUT_PATH_PREFIX)

Attempt = tuple[str, int]
_WIRE_KEYS = frozenset({"rollout_id", "attempt"})


@dataclass
class GateCounters:
    """What one installed gate has done; shared with whoever installed it (status, tests).

    ``parked`` is the number of requests waiting for admission right now; ``parks`` and
    ``refused`` count since install (requests that had to park, ``stale_attempt`` replies).
    """

    parked: int = 0
    parks: int = 0
    refused: int = 0
    # Told each parked request's wait in seconds (the metrics' gym.checkpoint.parked.duration); parked path only.
    observe_park: Callable[[float], None] | None = None


def is_exempt(path: str) -> bool:
    """Health and control routes: they pass whatever admission and marks say."""
    return path in _EXACT_EXEMPT or path.startswith("/health") or path.startswith(CONTROL_PATH_PREFIX)


@lru_cache(maxsize=4096)
def _parse_capture_key(key: str) -> Attempt | None:
    # Cached because the same rollout sends many requests (model calls, tool calls) under one key;
    # invalid keys are cached as None too, and the bound keeps a flood of junk keys harmless.
    try:
        episode = from_capture_key(key)
    except ValueError:
        return None
    return episode.rollout_id, episode.attempt


def attempt_from_path(path: str) -> Attempt | None:
    """``(rollout_id, attempt)`` named by a ``/ng-rollout/<capture key>/...`` path, else None."""
    if not path.startswith(ROLLOUT_PATH_PREFIX):
        return None
    end = path.find("/", _KEY_START)
    if end <= _KEY_START:
        return None
    return _parse_capture_key(path[_KEY_START:end])


def episode_of_run_body(body: bytes) -> EpisodeId | None:
    """The episode attempt a ``/run`` body names; None for anything malformed or unnamed.

    Its ``episode_id`` when it has one; else, for a legacy row (``legacy_agent``), the capture
    key Gym derives for it (``_ng_rollout_id``, or the task and rollout indices).
    """
    try:
        data = orjson.loads(body)
    except ValueError:  # orjson.JSONDecodeError: not JSON, not UTF-8, NaN, nested too deep
        data = json_as_gym_reads(body)
    if not isinstance(data, dict):
        return None
    try:
        if "episode_id" in data:
            return episode_from_wire(data["episode_id"])
        # Imported here: only legacy rows need it, and it loads Gym's global config module (~1 s).
        from nemo_gym.rollout_correlation import maybe_rollout_id_from_run_body

        key = maybe_rollout_id_from_run_body(data)
        return None if key is None else from_capture_key(key)
    except (ValueError, TypeError):  # pydantic's ValidationError is a ValueError
        return None


def json_as_gym_reads(body: bytes) -> Any:
    """The body as Gym's routes read it, for what orjson refused; None when Gym cannot read it either.

    Starlette's ``Request.json()`` is ``json.loads(body)``, which detects UTF-8 (with or without a
    BOM), UTF-16 and UTF-32 by the byte pattern and accepts ``NaN`` and ``Infinity``. Only bodies
    orjson refused pay for this second parse, so a body Gym would run is always attributed.
    """
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None


def plain_run_attempt(body: bytes) -> Attempt | None:
    """The usual ``/run`` body's pair: an exact ``{"rollout_id": str, "attempt": int}`` ``EpisodeId`` takes as it is.

    None for any other body (not JSON, another shape, an id ``EpisodeId`` would decode or refuse): ask
    ``attempt_from_run_body``. The pair is had without building an ``EpisodeId``.
    """
    try:
        data = orjson.loads(body)
    except ValueError:
        return None
    if type(data) is dict:
        wire = data.get("episode_id")
        if type(wire) is dict and wire.keys() <= _WIRE_KEYS:
            rollout_id: Any = wire.get("rollout_id")
            attempt: Any = wire.get("attempt", 0)
            if is_plain_episode(rollout_id, attempt):
                return rollout_id, attempt
    return None


def attempt_from_run_body(body: bytes) -> Attempt | None:
    """``(rollout_id, attempt)`` of ``episode_of_run_body``; None for anything malformed or unnamed."""
    # The usual body first (every /run while marks are present or admission is closed).
    plain = plain_run_attempt(body)
    if plain is not None:
        return plain
    episode = episode_of_run_body(body)
    return None if episode is None else (episode.rollout_id, episode.attempt)


# Scope keys through which the plugin's middlewares on one request share a ``/run`` body: the bytes the
# app will read (set by whichever middleware buffered them first) and the attempt they name, once parsed.
RUN_BODY = "ng_checkpoint.run_body"
RUN_ATTEMPT = "ng_checkpoint.run_attempt"


async def run_body_attempt(scope: Scope, receive: Receive) -> tuple[Attempt | None, Receive]:
    """The attempt a ``POST /run`` body names, buffered and parsed at most once per request.

    The explicit-id decoding, the gate and a worker's restored-record claims all read the same body:
    the first to need it buffers it (and records it in the scope), the first to need the attempt parses
    it; the others reuse both. Returns the ``receive`` to hand on (a replay when this call buffered).
    """
    if RUN_ATTEMPT in scope:
        return scope[RUN_ATTEMPT], receive
    body = scope.get(RUN_BODY)
    if body is None:
        body, receive = await buffer_body(receive)
        scope[RUN_BODY] = body
    attempt = scope[RUN_ATTEMPT] = attempt_from_run_body(body)
    return attempt, receive


class AdmissionGate:
    """Pure ASGI middleware: park data requests while admission is closed, refuse retired attempts.

    Built by Starlette from ``install_gate``'s arguments; do not wrap it in
    ``BaseHTTPMiddleware`` (that would buffer responses and break streaming).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        admission: Admission,
        marks: RetiredMarks,
        counters: GateCounters,
        run_path: str | None = "/run",
    ) -> None:
        self._app = app
        self._admission = admission
        self._marks = marks
        self._counters = counters
        self._run_path = run_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        admission = self._admission
        if not admission.served and scope["type"] == "http" and not is_exempt(scope["path"]):
            # Once per process: from the first data request on, this server refuses restores.
            admission.served = True
        # Fast path, taken by every request outside checkpoints while nothing is retired.
        if admission.is_open and not self._marks:
            await self._app(scope, receive, send)
            return
        if scope["type"] != "http" or is_exempt(scope["path"]):
            await self._app(scope, receive, send)
            return
        admitted = await self.admit(scope, receive, send)
        if admitted is not None:
            await self._app(scope, admitted, send)

    async def admit(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """The gate's decision for one data request past the fast path: the ``receive`` to hand on, or None.

        None: the request was answered here (refused ``stale_attempt``). Parks while admission is
        closed. ``__call__`` hands the request on at once; a worker's front (``_workers.front``) runs
        its restored-record claim first, as the claims middleware inside the gate did.
        """
        path = scope["path"]
        attempt = attempt_from_path(path)
        if attempt is None and path == self._run_path and scope.get("method") == "POST":
            attempt, receive = await run_body_attempt(scope, receive)
        if attempt is not None and self._marks.is_retired(*attempt):
            await self.refuse(send, attempt)
            return None
        if not self._admission.is_open:
            if not await self._park(send, attempt):
                return None
            # Nothing is awaited between this check and the call: admission is still open and the
            # mark cannot have risen in between.
            if attempt is not None and self._marks.is_retired(*attempt):
                await self.refuse(send, attempt)
                return None
        return receive

    async def _park(self, send: Send, attempt: Attempt | None) -> bool:
        """Wait for admission to open; False when the attempt was retired meanwhile (refused then)."""
        counters = self._counters
        counters.parked += 1
        counters.parks += 1
        parked_at = time.monotonic()
        try:
            if attempt is None:
                # Returns only with admission open: a wake that finds a new checkpoint already
                # closed admission parks again inside wait_open.
                await self._admission.wait_open()
                return True
            # An attributed request also wakes when a mark rises over its attempt and is refused at
            # once; it stays registered until answered, so a retire can wait for it to leave.
            with self._marks.parking(*attempt) as parked:
                while not self._admission.is_open and not parked.retired:
                    await self._admission.wait_open_or(parked.woken)
                if parked.retired:
                    # Refused even if the rollout was forgotten since: the mark rose while it was parked.
                    await self.refuse(send, attempt)
                    return False
                return True
        finally:
            counters.parked -= 1
            if counters.observe_park is not None:
                counters.observe_park(time.monotonic() - parked_at)

    async def refuse(self, send: Send, attempt: Attempt) -> None:
        """Answer 409 ``stale_attempt`` for ``attempt`` and count it."""
        rollout_id, number = attempt
        up_to = self._marks.retired_up_to(rollout_id)
        since = "its mark was forgotten since" if up_to is None else f"retired up to attempt {up_to}"
        error = StaleAttempt(
            f"attempt {number} of rollout {rollout_id!r} was retired ({since})",
            rollout_id=rollout_id,
            attempt=number,
        )
        body = orjson.dumps(error.to_body())
        self._counters.refused += 1
        await send(
            {
                "type": "http.response.start",
                "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


def install_gate(
    app: Any,
    admission: Admission,
    marks: RetiredMarks,
    *,
    run_path: str | None = "/run",
    counters: GateCounters | None = None,
) -> GateCounters:
    """Add the admission gate to a Starlette/FastAPI ``app`` as its outermost middleware so far.

    Call it after the server's ``setup_webserver()`` added Gym's own middlewares, so that the
    gate sees the raw ``/ng-rollout/<key>/...`` path before Gym strips it; Gym's
    ``run_webserver`` then wraps exception and cancellation middleware around it.
    ``run_path`` is the route whose JSON body names the episode (None: attribute by path only).
    Returns the counters the gate updates (``counters`` when given: a worker's, which its
    coordinator reads for the metrics). Raises ``RuntimeError`` when the app already
    started (Starlette refuses new middleware then) or already has a gate: two gates over
    different state would disagree about admission.
    """
    if getattr(app.state, "ng_checkpoint_gate", None) is not None:
        raise RuntimeError("the admission gate is already installed on this app")
    counters = GateCounters() if counters is None else counters
    app.add_middleware(AdmissionGate, admission=admission, marks=marks, counters=counters, run_path=run_path)
    app.state.ng_checkpoint_gate = counters
    return counters
