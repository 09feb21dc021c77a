"""The model server's held responses: a pure ASGI middleware between the admission gate and Gym's routes.

Each data request to a model server runs its route in a task of its own, registered with the
``ModelCalls`` registry (``calls.py``) under the attempt its ``/ng-rollout/<key>/...`` path
names, so a retire can stop it (the inference worker sees its request dropped when the
route's outgoing call is cancelled) and wait for it.

While admission is closed, a response that has not started reaching its caller is **held**:
the route keeps running (a call at the inference worker is never interrupted) and only its
first piece of answer data waits for resume. What does not start a response (docs/protocol.md,
"Mid-turn boundaries"):

- the ``http.response.start`` message (status and headers): kept back and sent together with
  the first body message that goes out, so a call stopped before its answer started can still
  be refused with ``stale_attempt``;
- empty body chunks (kept back in order with the headers);
- in an event stream (``content-type: text/event-stream``), chunks made only of SSE comment
  lines (``:`` first, e.g. Gym's ``: keep-alive``) and blank lines: they go out at once, so a
  long generation keeps its connection alive.

With generation cuts on, the request body is kept as it arrives (its digest names the call a
cut belongs to) and the call is the route's current model call (``calls.current_call``), so the
worker client the cuts wrap knows whose generation it streams.

Anything else is answer data, and so is the end of a response (the last body message, even
empty): the caller would see a complete reply. Once a response started, every later message
passes untouched: an event stream that already started finishes whatever admission does.
A held response is delivered unchanged (the very same messages, in order) after resume.

Every body chunk of an answered (2xx) call is scanned, before it goes out or is held, for the
output tokens its usage reports (``output_tokens.py``; the commit reply's ``answered_output_tokens``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson

from nemo_gym_checkpoint_plugin._asgi import ASGIApp, Message, Receive, Scope, Send
from nemo_gym_checkpoint_plugin._errors import StaleAttempt
from nemo_gym_checkpoint_plugin._gate import attempt_from_path, is_exempt

if TYPE_CHECKING:
    from nemo_gym_checkpoint_plugin.builtin_participants.model.calls import ModelCall, ModelCalls

__all__ = ["HeldResponses", "SSEScan", "install_held_responses"]

_LF, _CR, _COLON = 0x0A, 0x0D, 0x3A


class SSEScan:
    """Whether the chunks of one event stream carry answer data yet (state kept across chunk boundaries).

    A line is data unless it is blank or starts with ``:`` (a comment); ``\\n``, ``\\r`` and
    ``\\r\\n`` all end a line, as the SSE format allows.
    """

    __slots__ = ("_in_comment",)

    def __init__(self) -> None:
        # True while inside a comment line that continues into the next chunk.
        self._in_comment = False

    def has_data(self, chunk: bytes) -> bool:
        i, n = 0, len(chunk)
        while i < n:
            if not self._in_comment:
                byte = chunk[i]
                if byte in (_LF, _CR):
                    i += 1
                    continue
                if byte != _COLON:
                    return True
                self._in_comment = True
            ends = [j for j in (chunk.find(b"\n", i), chunk.find(b"\r", i)) if j >= 0]
            if not ends:
                return False  # the comment goes on in the next chunk
            self._in_comment = False
            i = min(ends) + 1
        return False


def _is_event_stream(start: Message) -> bool:
    for name, value in start.get("headers") or ():
        if name.lower() == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"text/event-stream"
    return False


class _Delivery:
    """The ``send`` a route's task gets: holds its response until it may start, then passes everything."""

    __slots__ = ("_send", "_call", "_calls", "_kept", "_sse", "started", "sent_any")

    def __init__(self, send: Send, call: ModelCall, calls: ModelCalls) -> None:
        self._send = send
        self._call = call
        self._calls = calls
        self._kept: list[Message] = []  # the start message and empty chunks, not sent yet
        self._sse: SSEScan | None = None
        self.started = False  # answer data went out
        self.sent_any = False  # anything went out (the status line is then fixed)

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.body" and self._call.usage is not None:
            self._calls.answer_data(self._call, message.get("body", b""))
        if self.started:
            await self._send(message)
            return
        if kind == "http.response.start":
            if 200 <= int(message.get("status", 0)) < 300:
                self._calls.answered(self._call)
            await self._calls.starting(self._call)
            self._kept.append(message)
            if _is_event_stream(message):
                self._sse = SSEScan()
            return
        if kind != "http.response.body":
            await self._flush()
            await self._send(message)
            return
        body = message.get("body", b"")
        if message.get("more_body", False) and (not body or (self._sse is not None and not self._sse.has_data(body))):
            if not body:
                self._kept.append(message)
                return
            await self._flush()  # an SSE comment (keep-alive): not an answer, and it keeps the line alive
            await self._send(message)
            return
        # The first answer data, or the end of the response: it waits while admission is closed.
        await self._calls.hold(self._call)
        self.started = True
        self._calls.delivered(self._call)
        await self._flush()
        await self._send(message)

    async def _flush(self) -> None:
        kept, self._kept = self._kept, []
        for message in kept:
            self.sent_any = True
            await self._send(message)
        self.sent_any = True


class HeldResponses:
    """Pure ASGI middleware of a model server (see the module docstring). Health and control routes pass."""

    def __init__(self, app: ASGIApp, *, calls: ModelCalls) -> None:
        self._app = app
        self._calls = calls

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_exempt(scope["path"]):
            await self._app(scope, receive, send)
            return
        call = self._calls.begin(attempt_from_path(scope["path"]))
        delivery = _Delivery(send, call, self._calls)
        if self._calls.cuts is not None and call.key is not None:
            receive = _kept_body(receive, call)
        # Registered before the first suspension: a retire marking this attempt after the gate let the
        # request in finds it here, and its task (which cancelling stops wherever it is).
        task = asyncio.ensure_future(self._run(call, scope, receive, delivery.send))
        call.task = task
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not call.retired or (current is not None and current.cancelling()):
                raise  # the caller went away (or the server stops): nothing to answer
            if not delivery.sent_any:
                await _refuse(send, call)
            # Else the status line is out: the connection just ends, the stream cut short.
        finally:
            self._calls.end(call)

    async def _run(self, call: ModelCall, scope: Scope, receive: Receive, send: Send) -> None:
        from nemo_gym_checkpoint_plugin.builtin_participants.model.calls import _CURRENT_CALL

        _CURRENT_CALL.set(call)  # this task's own context: the route's calls to the worker see it
        await self._calls.arrived(call)
        await self._app(scope, receive, send)


def _kept_body(receive: Receive, call: ModelCall) -> Receive:
    """``receive`` that also keeps the request body in ``call.body`` as the route reads it."""
    call.body = bytearray()

    async def kept() -> Message:
        message = await receive()
        if message["type"] == "http.request" and call.body is not None:
            call.body += message.get("body", b"")
        return message

    return kept


async def _refuse(send: Send, call: ModelCall) -> None:
    error = StaleAttempt(
        f"attempt {call.attempt} of rollout {call.rollout_id!r} was retired while its model call ran",
        rollout_id=call.rollout_id,
        attempt=call.attempt,
    )
    body = orjson.dumps(error.to_body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install_held_responses(app: Any, calls: ModelCalls) -> None:
    """Add the middleware to a model server's app (before the admission gate, which must stay outside it)."""
    app.add_middleware(HeldResponses, calls=calls)
