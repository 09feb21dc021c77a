"""ASGI helpers shared by the plugin's pure ASGI middlewares (gate, reply declarations, run tracking).

The ASGI types are Starlette's. ``buffer_body`` reads a request's body once, and hands the
app a ``receive`` that replays the very same messages, so a middleware can look at the
body and the route still reads it unchanged.
"""

from __future__ import annotations

from collections import deque

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["ASGIApp", "Message", "Receive", "Scope", "Send", "buffer_body"]


async def buffer_body(receive: Receive) -> tuple[bytes, Receive]:
    """Read every request message up to the last body chunk (or a disconnect).

    Returns the body and a ``receive`` that hands the buffered messages over first, then the
    live channel (so the app still sees a later disconnect).
    """
    first = await receive()
    if first["type"] == "http.request" and not first.get("more_body", False):
        # The usual request: its whole body in one message (no list, join or deque to build).
        handed = False

        async def replay_one() -> Message:
            nonlocal handed
            if handed:
                return await receive()
            handed = True
            return first

        return first.get("body", b""), replay_one
    messages: list[Message] = [first]
    if first["type"] != "http.request":
        return b"", _replay(messages, receive)
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
    return body, _replay(messages, receive)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = deque(messages)

    async def replay() -> Message:
        if pending:
            return pending.popleft()
        return await receive()

    return replay
