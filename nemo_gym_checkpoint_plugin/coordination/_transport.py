"""HTTP for control calls: a connection pool of their own, bodies encoded once.

Data calls (``/run`` and everything a rollout sends) may all be parked behind a
closed admission gate while a checkpoint is taken. If control calls shared
their pool, parked data calls holding every connection would starve the very
prepare, commit or resume that releases them. So control calls go through a
``ControlTransport``: its own aiohttp session and connector, never Gym's global
client, with a small reserved limit per host.

A fan-out encodes its body once (``encode_body``, orjson) and sends the same
bytes to every participant. Every call is bounded: the caller gives a timeout
and a call that has not completed by then fails with ``timeout``; a refused or
dropped connection fails with ``unreachable``; a refusal from the participant
keeps its docs/protocol.md code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from .._telemetry import spans
from ._errors import BAD_REPLY, TIMEOUT, UNREACHABLE, ParticipantFailure

__all__ = ["CONTROL_PREFIX", "CallFailed", "ControlTransport", "Endpoint", "encode_body"]

from .._wire import CONTROL_PREFIX


@dataclass(frozen=True)
class Endpoint:
    """A server to call: its config name (or URL when it has none) and its base URL."""

    name: str
    url: str


class CallFailed(Exception):
    """One control call failed; ``failure`` says who, which code and why."""

    def __init__(self, failure: ParticipantFailure) -> None:
        super().__init__(failure.describe())
        self.failure = failure


def encode_body(payload: Mapping[str, Any]) -> bytes:
    """Encode a fan-out body once; the same bytes go to every participant."""
    return orjson.dumps(payload)


def _excerpt(raw: bytes) -> str:
    """The start of a reply as text for a message (never a bytes repr)."""
    text = raw[:120].decode("utf-8", "replace")
    return text + ("..." if len(raw) > 120 else "") if text else "(empty body)"


def _refusal(endpoint: Endpoint, operation: str, status: int, raw: bytes) -> ParticipantFailure:
    """A non-2xx reply: the protocol's ``{"error": {"code", "detail"}}`` if it is one."""
    code, detail = f"http_{status}", raw[:300].decode("utf-8", "replace") or "(empty body)"
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    episodes: tuple[str, ...] = ()
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
        code = str(error.get("code") or code)
        detail = str(error.get("detail") or "")
        named = error.get("episode_ids")
        if isinstance(named, list):
            episodes = tuple(str(key) for key in named if isinstance(key, str))
    elif isinstance(body, dict) and "detail" in body:
        # FastAPI's own 422 for a body the route refused.
        detail = orjson.dumps(body["detail"]).decode()[:300]
    return ParticipantFailure(endpoint.name, endpoint.url, operation, code, detail, status, episodes)


class ControlTransport:
    """The reserved control pool. Create and close it inside the event loop that uses it.

    ``limit_per_host`` bounds control connections to one participant; a fan-out sends one
    call per participant at a time, so a small number is enough and never competes with
    data calls, which use another session.
    """

    def __init__(self, auth_token: str | None, *, limit_per_host: int = 4) -> None:
        self._headers = {"Content-Type": "application/json"}
        if auth_token:
            self._headers["Authorization"] = f"Bearer {auth_token}"
        self._limit_per_host = limit_per_host
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=self._limit_per_host)
            # A dummy jar: a control reply's cookies must never ride along on another participant's call.
            self._session = aiohttp.ClientSession(
                connector=connector, cookie_jar=aiohttp.DummyCookieJar(), timeout=aiohttp.ClientTimeout()
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> ControlTransport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(self, endpoint: Endpoint, operation: str, body: bytes | None, *, timeout: float) -> dict[str, Any]:
        """``GET status`` (``body`` None) or ``POST <operation>`` with ``body``; the reply object.

        Raises ``CallFailed`` with ``unreachable``, ``timeout``, ``bad_reply`` or the
        participant's own refusal code. Never waits longer than ``timeout`` seconds.
        """
        url = f"{endpoint.url}{CONTROL_PREFIX}/{operation}"
        method = "GET" if body is None else "POST"

        def fail(code: str, detail: str, status: int | None = None) -> CallFailed:
            return CallFailed(ParticipantFailure(endpoint.name, endpoint.url, operation, code, detail, status))

        session = self._get_session()
        headers = self._headers
        if spans.enabled():
            headers = dict(headers)
            spans.inject(headers)  # the current call span's traceparent (docs/telemetry.md)
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                async with session.request(method, url, data=body, headers=headers) as response:
                    raw = await response.read()
                    status = response.status
        except TimeoutError:
            raise fail(TIMEOUT, f"no reply within {timeout:.1f}s") from None
        except aiohttp.ClientConnectionError as exc:
            raise fail(UNREACHABLE, f"{type(exc).__name__}: {exc}") from None
        except aiohttp.ClientError as exc:
            raise fail(BAD_REPLY, f"{type(exc).__name__}: {exc}") from None
        if not 200 <= status < 300:
            raise CallFailed(_refusal(endpoint, operation, status, raw))
        try:
            reply = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise fail(BAD_REPLY, f"reply is not JSON: {_excerpt(raw)}", status) from None
        if not isinstance(reply, dict):
            raise fail(BAD_REPLY, f"reply is not a JSON object: {_excerpt(raw)}", status)
        return reply
