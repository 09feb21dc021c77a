"""``ReplyHeaders``: a pure ASGI middleware that adds headers to the replies of one POST route.

Used by the built-in participants to declare, on a server's own replies, what the
checkpoint protocol needs the caller to know (a resources seed's
``x-ng-checkpoint-restart``, an agent session's capture declaration) without changing
the server's handlers. Only the named route's request body is buffered (the app then
receives the very same messages); every other request passes untouched. A route may be
prefixed with ``/ng-rollout/<key>``, as the plugin's client sends attributed calls.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from nemo_gym_checkpoint_plugin._asgi import Message, buffer_body
from nemo_gym_checkpoint_plugin._wire import ROLLOUT_PATH_PREFIX

__all__ = ["ReplyHeaders", "route_of"]

HeadersFor = Callable[[bytes, int], Awaitable[dict[str, str]]]
_ROLLOUT_PREFIX = ROLLOUT_PATH_PREFIX


def route_of(path: str) -> str:
    """``path`` without a leading ``/ng-rollout/<key>`` segment."""
    if path.startswith(_ROLLOUT_PREFIX):
        rest = path[len(_ROLLOUT_PREFIX) :].partition("/")[2]
        return "/" + rest
    return path


class ReplyHeaders:
    """Call ``headers_for(request body, reply status)`` before the reply starts and add what it returns."""

    def __init__(self, app: Any, *, path: str, headers_for: HeadersFor) -> None:
        self.app = app
        self.path = path
        self.headers_for = headers_for

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or route_of(scope.get("path", "")) != self.path:
            await self.app(scope, receive, send)
            return
        body, replay = await buffer_body(receive)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = await self.headers_for(body, int(message["status"]))
                if extra:
                    headers = list(message.get("headers", []))
                    headers += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in extra.items()]
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, replay, send_with_headers)
