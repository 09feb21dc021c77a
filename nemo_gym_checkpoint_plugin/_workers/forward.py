"""Control requests on a worker's shared port, answered by the coordinator in the main process.

A server with several workers has one participant, its coordinator (``coordinator.py``); the
controller still calls the server's one port, which uvicorn hands to any worker. Each worker's
``ForwardControl`` (outermost ASGI middleware) sends every request under ``/ng-control/`` over
its link as one ``control`` message: method, path, query string, headers and body (base64; a body
whose ``Content-Length`` is over the routes' limit is not read: the routes refuse it from the
header with 413, as on a single worker). The coordinator runs it through the plane's control
routes (``answer_forwarded``: the same FastAPI router, bearer check and error bodies as a
single-worker server) and sends back status, headers and body, which the worker replies.

When the coordinator cannot be reached (its process is gone, or it does not answer within
``FORWARD_TIMEOUT_SECONDS``, longer than any deadline a control call may name) the worker
answers 503 ``coordinator_unreachable`` naming why, never a 500.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import orjson

from nemo_gym_checkpoint_plugin._asgi import ASGIApp, Receive, Scope, Send
from nemo_gym_checkpoint_plugin._wire import CONTROL_PATH_PREFIX

from . import messages as m
from .link import Link, LinkError

__all__ = ["FORWARD_TIMEOUT_SECONDS", "ForwardControl", "answer_forwarded", "forward_control", "is_control_path"]

# A control call's deadline is at most 24 hours ahead (the routes refuse more); its reply comes by then.
FORWARD_TIMEOUT_SECONDS = 24 * 3600 + 60.0
# The routes' own body limit (BodyLimits.max_body_bytes default): a longer body is refused from its header.
_MAX_READ = 64 * 1024 * 1024


def is_control_path(path: str) -> bool:
    return path == "/ng-control" or path.startswith(CONTROL_PATH_PREFIX)


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        chunks.append(chunk)
        if size > limit or not message.get("more_body", False):
            return b"".join(chunks)  # over the limit: the routes see more than they take and say 413


class ForwardControl:
    """Pure ASGI middleware on a worker: control requests go to the coordinator, the rest pass untouched."""

    def __init__(self, app: ASGIApp, *, link: Callable[[], Link | None]) -> None:
        self._app = app
        self._link = link

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_control_path(scope["path"]):
            await self._app(scope, receive, send)
            return
        await forward_control(self._link(), scope, receive, send)


async def forward_control(link: Link | None, scope: Scope, receive: Receive, send: Send) -> None:
    """Send one control request over ``link`` to the coordinator and reply its answer (503 when unreachable)."""
    headers = list(scope.get("headers") or [])
    declared = _content_length(headers)
    body = b"" if declared is not None and declared > _MAX_READ else await _read_body(receive, _MAX_READ)
    request = {
        "method": scope.get("method", "GET"),
        "path": scope["path"],
        "query_string": bytes(scope.get("query_string") or b"").decode("latin-1"),
        "headers": [[name.decode("latin-1"), value.decode("latin-1")] for name, value in headers],
        "body": base64.b64encode(body).decode("ascii"),
    }
    try:
        if link is None:
            raise LinkError("this worker has not registered with its coordinator yet", op=m.CONTROL)
        reply = await link.call(m.CONTROL, request, timeout=FORWARD_TIMEOUT_SECONDS)
        status = int(reply["status"])
        out_headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in reply["headers"]]
        out_body = base64.b64decode(reply["body"])
    except LinkError as exc:
        status, out_body = (
            503,
            orjson.dumps(
                {
                    "error": {
                        "code": "coordinator_unreachable",
                        "detail": f"this server's coordinator did not answer the control call: {exc}",
                    }
                }
            ),
        )
        out_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(out_body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": out_headers})
    await send({"type": "http.response.body", "body": out_body})


async def answer_forwarded(app: ASGIApp, request: Mapping[str, Any]) -> dict[str, Any]:
    """Run one forwarded control request through ``app`` (the plane's control routes); its reply, encoded."""
    body = base64.b64decode(str(request["body"]))
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": str(request["method"]),
        "scheme": "http",
        "path": str(request["path"]),
        "raw_path": str(request["path"]).encode("utf-8"),
        "root_path": "",
        "query_string": str(request.get("query_string", "")).encode("latin-1"),
        "headers": [(str(k).encode("latin-1"), str(v).encode("latin-1")) for k, v in request.get("headers", ())],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
    }
    delivered = False
    done = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()  # the caller is still connected until the reply went out
        return {"type": "http.disconnect"}

    status = 500
    headers: list[list[str]] = []
    chunks: list[bytes] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = int(message["status"])
            headers = [[bytes(k).decode("latin-1"), bytes(v).decode("latin-1")] for k, v in message.get("headers", ())]
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                done.set()

    try:
        await app(scope, receive, send)
    finally:
        done.set()
    return {"status": status, "headers": headers, "body": base64.b64encode(b"".join(chunks)).decode("ascii")}
