"""A model call's generation streamed from the inference worker: what a cut of it holds, and the whole answer.

With generation cuts on, the model server asks the worker for every cuttable chat generation as
a stream (``stream: true``, ``stream_options.include_usage``), with ``return_token_ids`` (the
prompt's token ids in the first chunk, each chunk's generated ids) and per-token ``logprobs``,
also when its caller asked for a whole answer and none of those. ``Generation`` keeps what
arrived so far; ``assemble`` makes the whole answer the worker returns for the request without
``stream``, carrying exactly what the request asked back (token ids only with its
``return_token_ids``, logprobs only with its ``logprobs``).

A cut is a snapshot of a ``Generation``: ``snapshot`` (in the event loop) takes the lists as they
are and their lengths, and copies the few small fields; ``cut_record`` builds the record from it
in the storage writer's thread. The lists only ever grow and are never changed in place (a
continuation replaces ``content`` with a new list), so the prefixes read there are the snapshot's.
The request's digest is computed only when something needs it (a cut's record, a restored cut to
match), once.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Mapping
from typing import Any, NamedTuple

import orjson

__all__ = ["Generation", "Snapshot", "WorkerStreamError", "cut_digest", "request_sha256", "sse_events", "stream_chat"]


def request_sha256(body: bytes) -> str | None:
    """sha256 over the sorted JSON of a request body as its caller sent it; None when it is not JSON."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).hexdigest()


class Snapshot(NamedTuple):
    """What a cut of a generation saw, taken in the event loop (lists by reference, with their lengths)."""

    tokens: int
    content: list[str]
    content_parts: int
    reasoning: list[str]
    reasoning_parts: int
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None
    stop_reason: tuple[Any] | None
    response: dict[str, Any]
    reasoning_field: str


class WorkerStreamError(RuntimeError):
    """The worker's stream ended with an error event or could not be read."""


def cut_digest(prefix: Mapping[str, Any]) -> str:
    """sha256 over the sorted JSON of a cut's prefix fields (everything but its own digest)."""
    fields = {k: v for k, v in prefix.items() if k != "prefix_sha256"}
    return hashlib.sha256(orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)).hexdigest()


class Generation:
    """One generation as it arrives (chat deltas, or a continuation's raw text), in the event loop."""

    __slots__ = (
        "_body",
        "_digest",
        "sampling",
        "prompt_token_ids",
        "token_ids",
        "logprobs",
        "content",
        "reasoning",
        "reasoning_field",
        "tool_calls",
        "finish_reason",
        "stop_reason",
        "response",
        "usage",
        "continued_from",
    )

    def __init__(self, body: bytes | None, sampling: Mapping[str, Any], *, digest: str | None = None) -> None:
        self._body = body  # the request as its caller sent it (``digest`` given instead: tests)
        self._digest = digest
        self.sampling = dict(sampling)
        self.prompt_token_ids: list[int] | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[Any] = []
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.reasoning_field = "reasoning"
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.stop_reason: tuple[Any] | None = None  # (value,) once the worker said it
        self.response: dict[str, Any] = {}
        self.usage: dict[str, Any] | None = None
        self.continued_from = 0  # tokens this generation took over from a restored cut

    @property
    def request_sha256(self) -> str | None:
        if self._digest is None and self._body is not None:
            self._digest = request_sha256(self._body)  # idempotent: a race computes the same value twice
        return self._digest

    @property
    def cuttable(self) -> bool:
        """A cut needs the prompt's token ids and a logprob per generated token (a worker gives both or neither)."""
        return self.prompt_token_ids is not None and len(self.logprobs) == len(self.token_ids)

    # -- the chat stream ---------------------------------------------------------------------------

    def add_chat_chunk(self, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            raise WorkerStreamError(f"the worker streamed {type(chunk).__name__}, not a chunk object")
        if "error" in chunk:
            raise WorkerStreamError(f"the worker's stream ended with an error: {chunk['error']}")
        if not self.response:
            self.response = {k: chunk.get(k) for k in ("id", "created", "model")}
        if self.prompt_token_ids is None and isinstance(chunk.get("prompt_token_ids"), list):
            self.prompt_token_ids = list(chunk["prompt_token_ids"])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) == 0:
                self._add_choice(choice)

    def _add_choice(self, choice: Mapping[str, Any]) -> None:
        delta = choice.get("delta") or {}
        if delta.get("content"):
            self.content.append(delta["content"])
        for field in ("reasoning", "reasoning_content"):
            if delta.get(field):
                self.reasoning.append(delta[field])
                self.reasoning_field = field
        for call in delta.get("tool_calls") or ():
            entry = self.tool_calls.setdefault(
                int(call.get("index", 0)), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if call.get("id"):
                entry["id"] = call["id"]
            if call.get("type"):
                entry["type"] = call["type"]
            function = call.get("function") or {}
            if function.get("name"):
                entry["function"]["name"] += function["name"]
            if function.get("arguments"):
                entry["function"]["arguments"] += function["arguments"]
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and logprobs.get("content"):
            # One list per chunk, added with its token ids: the two stay the same length at every chunk.
            self.logprobs.extend(logprobs["content"])
        if choice.get("token_ids"):
            self.token_ids.extend(choice["token_ids"])
        if "stop_reason" in choice:
            self.stop_reason = (choice["stop_reason"],)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]

    # -- the whole answer --------------------------------------------------------------------------

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.reasoning:
            message[self.reasoning_field] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [
                dict(self.tool_calls[i], function=dict(self.tool_calls[i]["function"])) for i in sorted(self.tool_calls)
            ]
        return message

    def assemble(self, asked: Mapping[str, Any], message: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The whole answer the worker gives ``asked`` (the request as Gym sent it) without streaming."""
        choice: dict[str, Any] = {
            "index": 0,
            "message": dict(message) if message is not None else self.message(),
            "finish_reason": self.finish_reason,
            "logprobs": {"content": list(self.logprobs)} if asked.get("logprobs") else None,
        }
        if self.stop_reason is not None:
            choice["stop_reason"] = self.stop_reason[0]
        prompt = self.prompt_token_ids or []
        usage = (
            self.usage
            if self.usage and not self.continued_from
            else {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(self.token_ids),
                "total_tokens": len(prompt) + len(self.token_ids),
            }
        )
        completion: dict[str, Any] = {
            "id": self.response.get("id"),
            "object": "chat.completion",
            "created": self.response.get("created"),
            "model": self.response.get("model"),
            "choices": [choice],
            "usage": usage,
        }
        if asked.get("return_token_ids"):
            choice["token_ids"] = list(self.token_ids)
            completion["prompt_token_ids"] = list(prompt)
        return completion

    # -- cuts --------------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The cut as it stands, for ``cut_record`` (cheap: list references, lengths, small copies)."""
        return Snapshot(
            tokens=len(self.token_ids),
            content=self.content,
            content_parts=len(self.content),
            reasoning=self.reasoning,
            reasoning_parts=len(self.reasoning),
            tool_calls=self.message().get("tool_calls", []),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            response=dict(self.response),
            reasoning_field=self.reasoning_field,
        )

    def cut_record(self, snapshot: Snapshot) -> dict[str, Any] | None:
        """The cut at ``snapshot`` (safe in another thread); None when the request was no JSON (nothing to match)."""
        digest = self.request_sha256
        if digest is None:
            return None
        prefix: dict[str, Any] = {
            "request_sha256": digest,
            "sampling": self.sampling,
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids[: snapshot.tokens],
            "logprobs": self.logprobs[: snapshot.tokens],
            "response": snapshot.response,
            # The parsed text so far (raw while a continuation runs); the whole message once finished.
            "text": "".join(snapshot.content[: snapshot.content_parts]),
            "reasoning": "".join(snapshot.reasoning[: snapshot.reasoning_parts]),
            "reasoning_field": snapshot.reasoning_field,
            "tool_calls": snapshot.tool_calls,
            "finish_reason": snapshot.finish_reason,
        }
        if snapshot.stop_reason is not None:
            prefix["stop_reason"] = snapshot.stop_reason[0]
        prefix["prefix_sha256"] = cut_digest(prefix)
        return prefix


async def sse_events(response: Any) -> AsyncIterator[Any]:
    """The JSON events of a worker's event stream (``data: ...`` lines) until ``[DONE]``.

    Lines are split here, not by aiohttp's ``readline`` (its 64 KiB line limit is below a long
    prompt's first chunk, which carries every prompt token id).
    """
    buffer = bytearray()
    async for data in response.content.iter_any():
        buffer += data
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            line = bytes(buffer[start:end]).rstrip(b"\r")
            start = end + 1
            if not line.startswith(b"data:"):
                continue  # blank lines between events, comments
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            try:
                yield orjson.loads(payload)
            except orjson.JSONDecodeError as exc:
                raise WorkerStreamError(f"the worker streamed an event that is not JSON: {exc}") from None
        del buffer[:start]


async def worker_stream(client: Any, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
    """POST ``body`` to ``<client base_url><path>`` through Gym's client (its auth, pool and retries); the events.

    A non-2xx answer raises as Gym's own calls do (``ClientResponseError`` with the body). Leaving
    the iteration early (an error, a cancelled call) closes the connection: the worker sees the
    request dropped.
    """
    request = {"url": f"{client.base_url}{path}", "json": body}
    response = await client._request(method="POST", **request)  # Gym's NeMoGymAsyncOpenAI transport (0.7.x)
    finished = False
    try:
        await client._raise_for_status(response, request)
        async for event in sse_events(response):
            yield event
        finished = True
    finally:
        if finished:
            response.release()
        else:
            response.close()


async def stream_chat(client: Any, body: Mapping[str, Any], generation: Generation) -> dict[str, Any]:
    """Generate ``body`` as a stream into ``generation``; the whole answer the worker gives ``body``."""
    request = {**body, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if not body.get("logprobs"):
        # Asked for the cut; left out of the answer (``assemble`` follows ``body``).
        request.update(logprobs=True, top_logprobs=0)
    async for chunk in worker_stream(client, "/chat/completions", request):
        generation.add_chat_chunk(chunk)
    if generation.finish_reason is None:
        raise WorkerStreamError("the worker's stream ended before the generation finished")
    return generation.assemble(body)
