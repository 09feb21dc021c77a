"""Request/reply messages between a uvicorn worker and its coordinator over one Unix socket connection.

Either end may call the other (``Link.call``) on the same connection: a worker forwards
control calls and reports; the coordinator closes admission, asks for readiness, relays marks.
Each message is one frame: a 4-byte big-endian length, then one JSON line written by the
records codec (``_storage/codec.py``), so NaN, the infinities, ``-0.0``, integers beyond 64 bits
and key order arrive unchanged (orjson alone would write NaN as ``null`` and refuse big integers).

Nothing here can hang. Every call has a timeout covering both sending (a peer that stops
reading) and the reply, and ends in a reply or a typed ``LinkError``:

- ``MessageRefused``: the message is not plain JSON or is larger than the frame limit; nothing was sent;
- ``LinkClosed``: the connection is gone (the peer exited, crashed or closed it, or sent a frame
  that is not a message) before the reply came; every call waiting on it fails at once;
- ``LinkTimeout``: no reply within the timeout;
- ``LinkRemoteError``: the peer's handler failed with something that is not a protocol refusal.

A handler that raises a protocol refusal (a ``CheckpointError``) makes the caller raise the same
class with the same detail (its rendered body is kept as ``wire_body``), so a refusal crosses
the link typed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from nemo_gym_checkpoint_plugin._errors import ERRORS_BY_CODE, CheckpointError
from nemo_gym_checkpoint_plugin._storage.codec import NotJSON, decode_line, encode_line

__all__ = [
    "MAX_FRAME_BYTES",
    "Handler",
    "Link",
    "LinkClosed",
    "LinkError",
    "LinkRemoteError",
    "LinkTimeout",
    "MessageRefused",
    "connect",
    "serve",
]

logger = logging.getLogger(__name__)

# A restore's records for one worker ride in one message: generous, but bounded (a bad length
# prefix must not make the reader wait for gigabytes).
MAX_FRAME_BYTES = 256 * 1024 * 1024
_HEADER = struct.Struct(">I")

# handler(link, op, body) -> reply body (plain JSON), or raises.
Handler = Callable[["Link", str, Any], Awaitable[Any]]


class LinkError(Exception):
    """A message between a worker and the coordinator did not complete. ``peer`` and ``op`` say which."""

    def __init__(self, detail: str, *, peer: str | None = None, op: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.peer = peer
        self.op = op


class MessageRefused(LinkError):
    """The message cannot be sent as it is (not plain JSON, or over the frame limit); nothing was sent."""


class LinkClosed(LinkError):
    """The connection closed (or was never made) before the reply arrived."""


class LinkTimeout(LinkError):
    """The message was not sent, or not answered, within the call's timeout."""


class LinkRemoteError(LinkError):
    """The peer's handler failed with an error that is not a protocol refusal (``code`` says what kind)."""

    def __init__(self, detail: str, *, code: str, peer: str | None = None, op: str | None = None) -> None:
        super().__init__(detail, peer=peer, op=op)
        self.code = code


def _frame(message: dict[str, Any], max_frame: int) -> bytes:
    try:
        payload = encode_line(message)
    except NotJSON as exc:
        raise MessageRefused(f"not a plain JSON message: {exc}") from None
    if len(payload) > max_frame:
        raise MessageRefused(f"a {len(payload)}-byte message is over the {max_frame}-byte frame limit")
    return _HEADER.pack(len(payload)) + payload


def _refusal_of(error: dict[str, Any], peer: str, op: str) -> Exception:
    code = str(error.get("code", "worker_link_error"))
    detail = str(error.get("detail", ""))
    cls = ERRORS_BY_CODE.get(code)
    if cls is None:
        return LinkRemoteError(detail, code=code, peer=peer, op=op)
    refusal = cls(detail)
    body = error.get("body")
    if isinstance(body, dict):
        refusal.wire_body = body  # type: ignore[attr-defined]
    return refusal


class Link:
    """One connection between a worker and the coordinator; use from one event loop.

    ``name`` names the peer in errors and logs (a worker's pid once it registered). ``handler``
    answers the peer's calls, each in its own task, so a slow one never delays another.
    ``on_close`` callbacks run once, with the link, when the connection ends for any reason.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        handler: Handler | None = None,
        name: str = "peer",
        max_frame: int = MAX_FRAME_BYTES,
    ) -> None:
        self.name = name
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self._max_frame = max_frame
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._handling: set[asyncio.Task[None]] = set()
        self._close_reason: str | None = None
        self._on_close: list[Callable[[Link], None]] = []
        self._reading = asyncio.get_running_loop().create_task(self._read_loop())

    @property
    def closed(self) -> bool:
        return self._close_reason is not None

    @property
    def close_reason(self) -> str | None:
        return self._close_reason

    def on_close(self, callback: Callable[[Link], None]) -> None:
        """Run ``callback(link)`` when the connection ends (at once if it already has)."""
        if self.closed:
            callback(self)
        else:
            self._on_close.append(callback)

    async def call(self, op: str, body: Any = None, *, timeout: float) -> Any:
        """Send ``op`` with ``body`` and return the peer's reply body; a ``LinkError`` (or a refusal) otherwise."""
        if not timeout > 0:
            raise ValueError(f"a link call needs a positive timeout, not {timeout!r}")
        if self.closed:
            raise LinkClosed(f"link to {self.name} is closed: {self._close_reason}", peer=self.name, op=op)
        call_id = next(self._ids)
        try:
            frame = _frame({"id": call_id, "op": op, "body": body}, self._max_frame)
        except MessageRefused as exc:
            raise MessageRefused(f"{op} to {self.name}: {exc.detail}", peer=self.name, op=op) from None
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = reply
        try:
            async with asyncio.timeout(timeout):
                self._writer.write(frame)
                await self._writer.drain()
                message = await reply
        except TimeoutError:
            raise LinkTimeout(f"{self.name} did not answer {op} within {timeout:g} s", peer=self.name, op=op) from None
        except (ConnectionError, OSError) as exc:
            self._close(f"send failed: {exc}")
            raise LinkClosed(f"cannot send {op} to {self.name}: {exc}", peer=self.name, op=op) from None
        finally:
            self._pending.pop(call_id, None)
        if "error" in message:
            raise _refusal_of(message["error"], self.name, op)
        return message.get("ok")

    async def aclose(self) -> None:
        """Close the connection; calls still waiting fail with ``LinkClosed``."""
        self._close("closed by this side")
        # Unsent data is dropped: a peer that stopped reading must not keep this side waiting.
        self._writer.transport.abort()
        self._reading.cancel()
        # A handler may close its own link (a worker exiting): it is not waited for by itself.
        others = [task for task in self._handling if task is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(self._reading, *others, return_exceptions=True)
        try:
            await self._writer.wait_closed()
        except (ConnectionError, OSError):
            pass  # already broken: closed all the same

    async def wait_closed(self) -> None:
        """Return once the connection has ended."""
        await asyncio.gather(self._reading, return_exceptions=True)

    def _close(self, reason: str) -> None:
        if self._close_reason is not None:
            return
        self._close_reason = reason
        self._writer.close()
        for call_id, reply in list(self._pending.items()):
            if not reply.done():
                detail = f"link to {self.name} closed before call {call_id} was answered: {reason}"
                reply.set_exception(LinkClosed(detail, peer=self.name))
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                logger.exception("on_close callback of the link to %s failed", self.name)

    async def _read_loop(self) -> None:
        reason = "the peer closed the connection"
        try:
            while True:
                header = await self._reader.readexactly(_HEADER.size)
                (length,) = _HEADER.unpack(header)
                if length > self._max_frame:
                    reason = f"the peer sent a {length}-byte frame, over the {self._max_frame}-byte limit"
                    return
                message = decode_line(await self._reader.readexactly(length))
                if not isinstance(message, dict):
                    reason = "the peer sent a frame that is not a message"
                    return
                self._dispatch(message)
        except asyncio.IncompleteReadError:
            pass
        except (ConnectionError, OSError) as exc:
            reason = f"connection error: {exc}"
        except ValueError as exc:
            reason = f"the peer sent a frame that is not JSON: {exc}"
        finally:
            self._close(reason)

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "re" in message:
            reply = self._pending.get(message["re"])
            if reply is not None and not reply.done():
                reply.set_result(message)
            return  # a reply to a call that timed out: dropped
        task = asyncio.get_running_loop().create_task(self._answer(message))
        self._handling.add(task)
        task.add_done_callback(self._handling.discard)

    async def _answer(self, message: dict[str, Any]) -> None:
        call_id, op = message.get("id"), str(message.get("op"))
        try:
            if self._handler is None:
                raise LinkRemoteError(f"{op}: this side answers no calls", code="worker_link_error")
            reply: dict[str, Any] = {"re": call_id, "ok": await self._handler(self, op, message.get("body"))}
        except CheckpointError as exc:
            reply = {"re": call_id, "error": {"code": exc.code, "detail": exc.detail, "body": exc.to_body()}}
        except LinkRemoteError as exc:
            reply = {"re": call_id, "error": {"code": exc.code, "detail": exc.detail}}
        except Exception as exc:
            logger.exception("handling %s from %s failed", op, self.name)
            reply = {"re": call_id, "error": {"code": "worker_link_error", "detail": f"{op} failed: {exc!r}"}}
        try:
            frame = _frame(reply, self._max_frame)
        except MessageRefused as exc:
            error = {"code": "worker_link_error", "detail": exc.detail}
            frame = _frame({"re": call_id, "error": error}, self._max_frame)
        if self.closed:
            return
        try:
            self._writer.write(frame)
            await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            self._close(f"reply failed: {exc}")


async def connect(path: str, *, timeout: float, handler: Handler | None = None, name: str = "coordinator") -> Link:
    """Open a link to the socket at ``path`` within ``timeout``; ``LinkClosed`` / ``LinkTimeout`` otherwise."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_unix_connection(path)
    except TimeoutError:
        raise LinkTimeout(f"could not connect to {name} at {path} within {timeout:g} s", peer=name) from None
    except OSError as exc:
        raise LinkClosed(f"cannot connect to {name} at {path}: {exc}", peer=name) from None
    return Link(reader, writer, handler=handler, name=name)


async def serve(
    path: str,
    on_link: Callable[[Link], None],
    *,
    handler: Handler | None = None,
    max_frame: int = MAX_FRAME_BYTES,
) -> asyncio.Server:
    """Listen on ``path``; each connection becomes a ``Link`` (answering with ``handler``) passed to ``on_link``."""

    def _accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        on_link(Link(reader, writer, handler=handler, name="unregistered worker", max_frame=max_frame))

    return await asyncio.start_unix_server(_accepted, path=path)
