"""Mid-turn boundaries of Simple Agent: a journal of each turn's completed model and tool calls.

``simple_agent``'s turn is one coroutine (``SimpleAgent._create_episode``): a loop of model
calls and tool calls whose state lives in locals. It is not forked here. Its two kinds of
outgoing call are intercepted instead, while a session's turn runs (``_ACTIVE``, a context
variable set by ``SimpleAgentTurns._create_episode``, ``turn_loop.py``):

- model calls go through the server's client, which becomes a ``JournaledClient``;
- tool calls go through ``nemo_gym.server_utils.request``, which the agent's module imports
  as ``http_request``: that module attribute is wrapped (``journaled_tool_request``), and
  answers exactly as before outside a session's turn.

Each completed call is appended to the session's ``Turn`` (its **boundary**): the model's
answer (its exact body bytes and its cookies), or the tool's status, body and cookies. Bodies are
kept as base64 text (``"body"``): replayed byte for byte, and a record holds one string per call
instead of the answer's nested JSON, which every checkpoint would otherwise walk, encode, decode
and check again (a turn's model answers are most of an agent record). Records written before
kept a model answer as its parsed JSON (``"response"``); those still restore. A turn sent
again after a restore (attempt N+1, same request) runs the same loop; its calls are answered
from the journal in order, each checked against the digest of the request it answers (a
request that differs drops the rest of the journal and goes live: nothing is spliced), and
the first call past the journal goes to the servers. Because the loop only sees the same
answers, the continued turn's result is that of an uninterrupted one (every call's output,
token ids included, exactly once).

Parking and readiness (``TurnBook``): while a checkpoint holds admission closed, a turn
parks before it starts a call and after each call completes (its next boundary). A model
call in flight never blocks a checkpoint (a response held by the model server belongs to no
checkpoint: the boundary is before it); from the moment its answer arrives until it is
recorded, and for the whole of a tool call (tools have effects and must not run twice), the
episode is a blocker. An export copies the journals, so nothing a parked turn does changes it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from typing import Any

from nemo_gym_checkpoint_plugin._client import CheckpointServerClient

__all__ = ["JournaledClient", "Turn", "TurnBook", "TurnRun", "journaled_tool_request", "request_digest"]

# The turn the current task runs (set around SimpleAgent._create_episode of a captured session).
_ACTIVE: ContextVar[TurnRun | None] = ContextVar("ng_checkpoint_agent_turn", default=None)
_KINDS = ("model", "tool")


def request_digest(payload: Any) -> str:
    """sha256 over the sorted JSON of a request (pydantic models dumped as JSON first)."""
    if hasattr(payload, "model_dump"):
        payload = payload.model_dump(mode="json", exclude_unset=True)
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _cookie_values(cookies: Any) -> dict[str, str]:
    return {str(name): str(getattr(morsel, "value", morsel)) for name, morsel in (cookies or {}).items()}


@dataclass
class Turn:
    """One session's turn in progress (or its last one): what it started from and its completed calls."""

    activation: int
    request_sha256: str
    # The session's resources cookies and observations when the turn began (a continued turn starts there).
    cookies_before: dict[str, str]
    observations_before: Any
    calls: list[dict[str, Any]] = field(default_factory=list)
    # Installed by a restore and not sent again yet: the next activation with this request continues it.
    restored: bool = False
    # Raised on every change of ``calls`` (``TurnRun``): part of the agent record's version (open_sessions.py).
    changes: int = field(default=0, compare=False)

    def to_wire(self, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The turn as its record holds it; ``calls``: a copy of ``self.calls`` taken earlier (else taken now)."""
        # A copy of the list: entries are never mutated once appended, so a later call changes no export.
        wire = {
            "activation": self.activation,
            "request_sha256": self.request_sha256,
            "cookies_before": dict(self.cookies_before),
            "calls": list(self.calls) if calls is None else calls,
        }
        # None is left out, not written as null (from_wire reads a missing one as None): a line without
        # ``null`` skips the checkpoint writer's NaN walk.
        if self.observations_before is not None:
            wire["observations_before"] = self.observations_before
        return wire

    @classmethod
    def from_wire(cls, raw: Any) -> Turn:
        """A restored turn; ``ValueError`` naming what is wrong."""
        # Decoded records are plain dicts: the exact type tests first (an ABC check costs more).
        if type(raw) is not dict and not isinstance(raw, Mapping):
            raise ValueError("turn must be a JSON object or null")
        activation, digest = raw.get("activation"), raw.get("request_sha256")
        cookies, calls = raw.get("cookies_before"), raw.get("calls")
        if not isinstance(activation, int) or isinstance(activation, bool) or activation < 1:
            raise ValueError("turn.activation must be an integer >= 1")
        if not isinstance(digest, str) or len(digest) != 64:
            raise ValueError("turn.request_sha256 must be a sha256 hex digest")
        if type(cookies) is not dict and not isinstance(cookies, Mapping):
            raise ValueError("turn.cookies_before must be a JSON object")
        if not isinstance(calls, list):
            raise ValueError("turn.calls must be a list")
        for index, call in enumerate(calls):
            if type(call) is dict and type(call.get("sha256")) is str and type(call.get("body")) is str:
                # This release's calls (decoded records are plain dicts): one pass of exact type tests.
                kind = call.get("call")
                if kind == "model" or (kind == "tool" and type(call.get("status")) is int):
                    continue
            # Decoded records are plain dicts: the exact type test first (an ABC check costs more).
            kind = call.get("call") if type(call) is dict or isinstance(call, Mapping) else None
            if kind is not None and type(call.get("sha256")) is str:
                if kind == "model":
                    if type(call.get("body")) is str or isinstance(call.get("response"), Mapping):
                        continue
                elif kind == "tool":
                    if type(call.get("status")) is int and type(call.get("body")) is str:
                        continue
            _refuse_call(index, call)
        # The decoded calls themselves: a restore's records are read once, by this install.
        return cls(
            activation,
            digest,
            {str(k): str(v) for k, v in cookies.items()},
            raw.get("observations_before"),
            list(calls),
            restored=True,
        )


def _refuse_call(index: int, call: Any) -> None:
    """Raise the ``ValueError`` that names what is wrong with a restored turn's call ``index``."""
    where = f"turn.calls[{index}]"
    if not isinstance(call, Mapping) or call.get("call") not in _KINDS:
        raise ValueError(f"{where} must be an object with call (model|tool)")
    if not isinstance(call.get("sha256"), str):
        raise ValueError(f"{where}: sha256 must be a string")
    if call["call"] == "model":
        raise ValueError(f"{where}: a model call needs its body (base64) or response object")
    raise ValueError(f"{where}: a tool call needs its status and body")


class _Content:
    def __init__(self, body: bytes) -> None:
        self._body = body

    async def read(self, *_args: Any) -> bytes:
        return self._body


class Recorded:
    """A completed call's answer, shaped as the aiohttp response the agent's loop reads."""

    def __init__(self, status: int, body: bytes, cookies: Mapping[str, str]) -> None:
        self.status = status
        self.ok = 200 <= status < 400
        self._body = body
        self.content = _Content(body)
        self.cookies: SimpleCookie = SimpleCookie()
        for name, value in cookies.items():
            self.cookies[name] = value

    async def read(self) -> bytes:
        return self._body

    def raise_for_status(self) -> None:  # a recorded call completed: only successful model answers are kept
        return None

    @classmethod
    def of(cls, entry: Mapping[str, Any]) -> Recorded:
        if entry["call"] == "model":
            body = entry.get("body")
            raw = base64.b64decode(body) if body is not None else json.dumps(entry["response"]).encode()
            return cls(200, raw, entry.get("cookies") or {})
        return cls(entry["status"], base64.b64decode(entry["body"]), entry.get("cookies") or {})


class TurnBook:
    """The agent's turns by session id, its admission as the turns see it, and the running activations."""

    def __init__(self, model_server: str) -> None:
        self.model_server = model_server
        self.turns: dict[str, Turn] = {}
        self._open = asyncio.Event()
        self._open.set()
        self.closed = False
        # Capture keys -> calls whose effect is not recorded yet (a tool call, a model answer being read).
        self._busy: dict[str, int] = {}
        self._tasks: dict[str, set[asyncio.Task[Any]]] = {}
        self._stopping: set[asyncio.Task[Any]] = set()
        self._generation = 0
        self._changed = asyncio.Event()
        # Turns waiting at a boundary for admission to reopen (status and tests read it).
        self.parked = 0

    # -- admission and readiness -------------------------------------------------------------------

    def close(self) -> None:
        self.closed = True
        self._open.clear()
        self._notify()

    def open(self) -> None:
        self.closed = False
        self._open.set()
        self._notify()

    async def park(self) -> None:
        """Wait while admission is closed (a wake that finds a new checkpoint closed parks again)."""
        if self._open.is_set():
            return
        self.parked += 1
        try:
            while not self._open.is_set():
                await self._open.wait()
        finally:
            self.parked -= 1

    def blockers(self) -> list[str]:
        return [key for key, count in self._busy.items() if count > 0]

    def wait_change(self) -> Coroutine[Any, Any, None]:
        """Awaitable: done once anything changed since this call (not since it first runs: the control plane
        awaits it as a task, and a blocker that clears before that task starts must still wake it)."""
        return self._wait_change(self._generation)

    async def _wait_change(self, seen: int) -> None:
        while self._generation == seen:
            await self._changed.wait()

    def _notify(self) -> None:
        self._generation += 1
        self._changed.set()
        self._changed = asyncio.Event()

    @contextmanager
    def busy(self, key: str) -> Iterator[None]:
        self._busy[key] = self._busy.get(key, 0) + 1
        try:
            yield
        finally:
            left = self._busy[key] - 1
            if left:
                self._busy[key] = left
            else:
                del self._busy[key]
            if self.closed:
                self._notify()

    # -- activations -------------------------------------------------------------------------------

    def track(self, key: str, task: asyncio.Task[Any]) -> None:
        self._tasks.setdefault(key, set()).add(task)

        def forget(done: asyncio.Task[Any]) -> None:
            tasks = self._tasks.get(key)
            if tasks is not None:
                tasks.discard(done)
                if not tasks:
                    del self._tasks[key]
            self._stopping.discard(done)

        task.add_done_callback(forget)

    def running(self) -> int:
        return sum(len(tasks) for tasks in self._tasks.values())

    async def stop(self, named: Callable[[str], bool]) -> None:
        """Cancel the activations of the keys ``named`` (once each: a retried retire only waits), wait for them."""
        tasks = [task for key, group in self._tasks.items() if named(key) for task in group]
        for task in tasks:
            if task not in self._stopping and not task.done():
                self._stopping.add(task)
                task.cancel()
        if tasks:
            await asyncio.wait(tasks)


@dataclass
class TurnRun:
    """One activation running a session's turn: replays the journal, then records each completed call."""

    book: TurnBook
    key: str
    turn: Turn
    cursor: int = 0

    def _replayed(self, kind: str, digest: str) -> dict[str, Any] | None:
        calls = self.turn.calls
        if self.cursor >= len(calls):
            return None
        entry = calls[self.cursor]
        if entry["call"] == kind and entry["sha256"] == digest:
            self.cursor += 1
            return entry
        # The continued turn asks something else than what was recorded: never splice, go live from here.
        del calls[self.cursor :]
        self.turn.changes += 1
        return None

    def _record(self, entry: dict[str, Any]) -> None:
        # A boundary. Past the replayed calls: the next call is live too.
        self.turn.calls.append(entry)
        self.turn.changes += 1
        self.cursor = len(self.turn.calls)

    async def model_call(self, send: Callable[[], Awaitable[Any]], payload: Any) -> Any:
        digest = request_digest(payload)
        entry = self._replayed("model", digest)
        if entry is not None:
            return Recorded.of(entry)
        await self.book.park()
        response = await send()  # a generation: never a blocker while it runs (or is held)
        if not response.ok:
            return response  # the agent raises; nothing completed
        with self.book.busy(self.key):
            body = await response.read()  # cached by aiohttp: the agent's own read gets the same bytes
            self._record(
                {
                    "call": "model",
                    "sha256": digest,
                    "body": base64.b64encode(body).decode(),
                    "cookies": _cookie_values(response.cookies),
                }
            )
        await self.book.park()
        return response

    async def tool_call(self, send: Callable[[], Awaitable[Any]], url: str, payload: Any) -> Any:
        digest = request_digest({"tool": url.rstrip("/").rsplit("/", 1)[-1], "arguments": payload})
        entry = self._replayed("tool", digest)
        if entry is not None:
            return Recorded.of(entry)
        await self.book.park()
        with self.book.busy(self.key):  # a tool has effects: the checkpoint waits for it to be recorded
            response = await send()
            body = await response.content.read()
            entry = {
                "call": "tool",
                "sha256": digest,
                "status": int(response.status),
                "body": base64.b64encode(body).decode(),
                "cookies": _cookie_values(response.cookies),
            }
            self._record(entry)
        await self.book.park()
        return Recorded.of(entry)


class JournaledClient(CheckpointServerClient):
    """The agent's server client: inside a captured turn, model calls go through the turn's journal."""

    async def request(self, server_name: str, url_path: str, method: str, **kwargs: Any) -> Any:
        run = _ACTIVE.get()
        if run is None or server_name != run.book.model_server or method.upper() != "POST":
            return await super().request(server_name=server_name, url_path=url_path, method=method, **kwargs)
        live = super().request
        return await run.model_call(
            lambda: live(server_name=server_name, url_path=url_path, method=method, **kwargs),
            kwargs.get("json"),
        )


def journaled_tool_request(original: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """``original`` (``nemo_gym.server_utils.request``), with the tool calls of a captured turn journaled."""

    async def request(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        run = _ACTIVE.get()
        if run is None or str(method).upper() != "POST":
            return await original(method, url, *args, **kwargs)
        return await run.tool_call(lambda: original(method, url, *args, **kwargs), str(url), kwargs.get("json"))

    request.__wrapped__ = original  # type: ignore[attr-defined]
    return request
