"""One fake generation served as vLLM's OpenAI server serves it: a chat answer, whole or streamed, or a completion.

Tokens are produced one at a time by the backend's clock (``FakeBackendState.token_turn``) and
counted per conversation as they are produced. What the answer carries follows vLLM's request
fields (checked against vLLM's OpenAI-compatible server, see docs/protocol.md "Generation cuts"):

- ``logprobs`` (chat: a bool, with ``top_logprobs``; completions: an int): per-token logprobs; with
  ``return_tokens_as_token_ids`` each token is written ``token_id:<n>``;
- ``return_token_ids``: the prompt's token ids (chat: top level; completions: on the choice) and
  the generated ids (the choice's ``token_ids``); streamed, the prompt's only in the first chunk and
  each chunk's ids as a delta;
- ``max_tokens`` (chat also ``max_completion_tokens``): a generation cut at it ends ``length``;
- ``stream`` with ``stream_options.include_usage``: a last chunk with the usage, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from .fake_answers import Answer, Deltas, message_of
from .fake_backend_state import FakeBackendState
from .fake_tokens import logprob_at

__all__ = ["ChatGeneration", "CompletionGeneration"]


def _limit(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def _sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class _Generation:
    """The tokens of ``answer`` from ``start`` on, produced at the backend's rate; ``max_tokens`` caps them."""

    def __init__(
        self,
        state: FakeBackendState,
        body: dict[str, Any],
        answer: Answer,
        conversation: str,
        start: int,
        max_tokens: int | None,
    ) -> None:
        self.state = state
        self.body = body
        self.answer = answer
        self.conversation = conversation
        self.start = start
        remaining = len(answer) - start
        self.end = start + (remaining if max_tokens is None else min(remaining, max_tokens))
        self.as_ids = bool(body.get("return_tokens_as_token_ids"))
        self.token_ids = bool(body.get("return_token_ids"))
        self.created = int(time.time())

    @property
    def finish_reason(self) -> str:
        if self.end < len(self.answer):
            return "length"
        return "tool_calls" if self.answer.tool_calls else "stop"

    def token_text(self, position: int) -> str:
        return f"token_id:{self.answer.tokens[position]}" if self.as_ids else self.answer.pieces[position]

    async def produce(self) -> AsyncIterator[int]:
        """Each position as its token is generated (counted then, whether or not it reaches anyone)."""
        due = asyncio.get_running_loop().time()
        for position in range(self.start, self.end):
            due = await self.state.token_turn(due)
            self.state.count_token(self.conversation)
            yield position

    def usage(self, prompt_tokens: int) -> dict[str, int]:
        completion = self.end - self.start
        total = prompt_tokens + completion
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": total}


class ChatGeneration(_Generation):
    """``/v1/chat/completions``: the answer from its first token, parsed as ``--tool-call-parser hermes`` would."""

    def __init__(
        self,
        state: FakeBackendState,
        body: dict[str, Any],
        answer: Answer,
        conversation: str,
        step: int,
        reasoning_parser: bool,
    ) -> None:
        super().__init__(state, body, answer, conversation, 0, _limit(body, "max_completion_tokens", "max_tokens"))
        self.id = f"chatcmpl-fake-{step}"
        self._messages, self._tools = body["messages"], body.get("tools") or []
        self._prompt: list[int] | None = None
        self.prompt_length = state.vocabulary.prompt_length(self._messages, self._tools)
        self.deltas = Deltas(answer, reasoning_parser)
        self.logprobs = bool(body.get("logprobs"))
        self.model = body.get("model") or "fake-model"

    @property
    def prompt(self) -> list[int]:
        """The prompt's token ids, rendered only when asked for (most calls of a big run never are)."""
        if self._prompt is None:
            self._prompt = self.state.vocabulary.render(self._messages, self._tools)
        return self._prompt

    def _logprob(self, position: int) -> dict[str, Any]:
        token = self.token_text(position)
        return {
            "token": token,
            "logprob": logprob_at(position, self.answer.tokens[position]),
            "bytes": list(token.encode()),
            "top_logprobs": [],
        }

    def _end_delta(self) -> dict[str, Any]:
        return self.deltas.unfinished() if self.end < len(self.answer) else {}

    async def whole(self) -> dict[str, Any]:
        deltas, entries = [], []
        async for position in self.produce():
            deltas.append(self.deltas.delta(position))
            entries.append(self._logprob(position))
        deltas.append(self._end_delta())
        choice: dict[str, Any] = {
            "index": 0,
            "message": message_of(deltas),
            "finish_reason": self.finish_reason,
            "logprobs": {"content": entries} if self.logprobs else None,
        }
        completion: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(self.prompt_length),
        }
        if self.token_ids:
            completion["prompt_token_ids"] = list(self.prompt)
            choice["token_ids"] = self.answer.tokens[self.start : self.end]
        return completion

    def worker_view(self, completion: dict[str, Any]) -> dict[str, Any]:
        """``completion`` as the worker itself sees it: with its prompt's and generation's token ids and logprobs."""
        choice = dict(completion["choices"][0])
        positions = range(self.start, self.end)
        choice["logprobs"] = {
            "content": [
                {"token": f"token_id:{self.answer.tokens[p]}", "logprob": logprob_at(p, self.answer.tokens[p])}
                for p in positions
            ]
        }
        choice["token_ids"] = self.answer.tokens[self.start : self.end]
        return {**completion, "prompt_token_ids": list(self.prompt), "choices": [choice]}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    async def stream(self) -> AsyncIterator[bytes]:
        first = self._chunk(
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        )
        if self.token_ids:
            first["prompt_token_ids"] = list(self.prompt)
        yield _sse(first)
        async for position in self.produce():
            delta = self.deltas.delta(position)
            last = position == self.end - 1
            if last:
                delta = {**delta, **self._end_delta()}
            logprobs = {"content": [self._logprob(position)]} if self.logprobs else None
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": self.finish_reason if last else None,
            }
            if self.token_ids:
                choice["token_ids"] = [self.answer.tokens[position]]
            yield _sse(self._chunk(choice))
        if (self.body.get("stream_options") or {}).get("include_usage"):
            yield _sse({**self._chunk({}), "choices": [], "usage": self.usage(self.prompt_length)})
        yield b"data: [DONE]\n\n"


class CompletionGeneration(_Generation):
    """``/v1/completions`` with a token-id prompt: the rest of the answer after the tokens the prompt ends with."""

    def __init__(
        self,
        state: FakeBackendState,
        body: dict[str, Any],
        answer: Answer,
        conversation: str,
        start: int,
        prompt: list[int],
        serial: int,
    ) -> None:
        super().__init__(state, body, answer, conversation, start, _limit(body, "max_tokens"))
        self.id = f"cmpl-fake-{serial}"
        self.prompt = prompt
        self.logprobs = body.get("logprobs") is not None
        self.model = body.get("model") or "fake-model"

    def _choice(self, positions: list[int], offset: int, first: bool, finish: str | None) -> dict[str, Any]:
        text = "".join(self.answer.pieces[p] for p in positions)
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if self.logprobs:
            tokens = [self.token_text(p) for p in positions]
            offsets, at = [], offset
            for p in positions:
                offsets.append(at)
                at += len(self.answer.pieces[p])
            lps = [logprob_at(p, self.answer.tokens[p]) for p in positions]
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": lps,
                "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps, strict=True)],
                "text_offset": offsets,
            }
        if self.token_ids:
            choice["token_ids"] = [self.answer.tokens[p] for p in positions]
            if first:
                choice["prompt_token_ids"] = list(self.prompt)
        return choice

    def _completion(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    async def whole(self) -> dict[str, Any]:
        positions = [position async for position in self.produce()]
        completion = self._completion(self._choice(positions, 0, True, self.finish_reason))
        completion["usage"] = self.usage(len(self.prompt))
        return completion

    async def stream(self) -> AsyncIterator[bytes]:
        offset, first = 0, True
        async for position in self.produce():
            last = position == self.end - 1
            yield _sse(self._completion(self._choice([position], offset, first, self.finish_reason if last else None)))
            offset += len(self.answer.pieces[position])
            first = False
        if self.start == self.end:  # nothing left to generate: one empty, finished choice
            yield _sse(self._completion(self._choice([], 0, True, self.finish_reason)))
        if (self.body.get("stream_options") or {}).get("include_usage"):
            yield _sse({**self._completion({}), "choices": [], "usage": self.usage(len(self.prompt))})
        yield b"data: [DONE]\n\n"
