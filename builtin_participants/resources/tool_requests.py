"""The resources server's requests under a rollout prefix: tool calls counted, each request tracked.

``ToolRequests`` (pure ASGI middleware, installed by ``session_bindings.install_resources_declarations``)
counts every tool call per rollout and each one answered 2xx per episode, and runs each
``POST /ng-rollout/<key>/...`` in a task of its own, registered with ``ResourcesSessions`` by capture key,
so a retire can stop it (``ResourcesSessions.retire``).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from nemo_gym_checkpoint_plugin._errors import StaleAttempt
from nemo_gym_checkpoint_plugin._identity import EpisodeId, from_capture_key
from nemo_gym_checkpoint_plugin._wire import ROLLOUT_PATH_PREFIX

if TYPE_CHECKING:
    from nemo_gym_checkpoint_plugin.builtin_participants.resources.session_bindings import ResourcesSessions

__all__ = ["InFlightRequest", "ToolRequests", "count_rollout"]

# How many rollouts' seed and tool-call counts status keeps (a diagnostic; the oldest are dropped first).
_COUNT_ROLLOUTS = 10_000


def count_rollout(counts: OrderedDict[str, int], rollout: str) -> None:
    counts[rollout] = counts.pop(rollout, 0) + 1
    while len(counts) > _COUNT_ROLLOUTS:
        counts.popitem(last=False)


# Gym's own resources routes; any other POST under a rollout prefix is a tool call.
_SESSION_ROUTES = frozenset({"seed_session", "verify", "close_session", "aggregate_metrics"})


class InFlightRequest:
    """One request in flight under a rollout prefix: its task, and whether a retire stopped it."""

    __slots__ = ("task", "retired")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.retired = False


class ToolRequests:
    """Pure ASGI middleware of ``POST /ng-rollout/<key>/...``: count tool calls, track requests.

    Each tool call is counted per rollout, and each one answered 2xx per episode (the ledger's
    ``answered_tool_calls``). Each such request (``/verify``, a tool call) runs in a task of its
    own, registered by capture key, so a retire can cancel it; one cancelled before its reply
    started is answered 409 ``stale_attempt``. Other requests pass untouched (one split, no body read).
    """

    def __init__(self, app: Any, sessions: ResourcesSessions) -> None:
        self.app = app
        self.sessions = sessions

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope.get("type") == "http" and scope.get("method") == "POST" else ""
        if not path.startswith(ROLLOUT_PATH_PREFIX):
            await self.app(scope, receive, send)
            return
        key, _, route = path[len(ROLLOUT_PATH_PREFIX) :].partition("/")
        if not route:
            await self.app(scope, receive, send)
            return
        reply = send
        if route not in _SESSION_ROUTES:
            try:
                episode: EpisodeId | None = from_capture_key(key)
            except ValueError:
                episode = None  # the gate lets an unparsable key through; Gym's routing answers it
            count_rollout(self.sessions.tool_calls_by_rollout, key if episode is None else episode.rollout_id)
            if episode is not None:
                reply = _answered(send, self.sessions, episode)
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = True
            await reply(message)

        # Registered before the first suspension: a retire marking this attempt after the gate let it in finds it.
        task = asyncio.ensure_future(self.app(scope, receive, tracked))
        request = self.sessions.request_began(key, task)
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not request.retired or (current is not None and current.cancelling()):
                raise  # the caller went away (or the server stops): nothing to answer
            if not started:
                await _refuse(send, key, route)
            # Else the reply had begun: the connection just ends.
        finally:
            self.sessions.request_ended(key, request)


async def _refuse(send: Any, key: str, route: str) -> None:
    import orjson

    error = StaleAttempt(f"episode {key} was retired while its /{route} ran here; it does not reply")
    body = orjson.dumps(error.to_body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _answered(send: Any, sessions: ResourcesSessions, episode: EpisodeId) -> Any:
    async def sending(message: Any) -> None:
        if message["type"] == "http.response.start" and 200 <= int(message.get("status", 0)) < 300:
            sessions.tool_answered(episode)
        await send(message)

    return sending
