"""Continue a restored cut: the rest of a generation from the worker, joined with its prefix into one answer.

docs/protocol.md, "Generation cuts". The agent's re-sent call whose request digest (and sampling)
matches a restored cut is answered by:

1. ``POST /v1/completions`` with ``prompt`` the cut's prompt token ids followed by its prefix's,
   ``max_tokens`` (or ``max_completion_tokens``) reduced by the prefix, the request's sampling
   parameters, ``stream``, ``return_token_ids`` and ``logprobs: 0`` (plus the request's
   ``return_tokens_as_token_ids``), so the remainder arrives token by token into the call's new
   ``Generation`` (a later checkpoint exports the longer prefix);
2. the prefix's text from ``POST /detokenize`` (vLLM's; the prefix and the remainder are then raw
   text, as generated);
3. the whole text parsed again (``cut_parse.py``: reasoning and tool calls), and the answer shaped
   as the worker shapes an uninterrupted one: the prefix's token ids and logprobs first, the
   remainder's after (completion logprobs turned into chat ones), the response's id and model
   those of the cut, usage counting the whole generation.

A cut whose generation had finished (its answer was ready but had not reached the agent) needs
no worker at all. Any failure (the worker refuses the prompt, a broken stream) raises
``ContinuationFailed``: the caller then generates the call from scratch, never splices.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import ClientError
from nemo_gym_checkpoint_plugin.builtin_participants.model.cut_parse import parse_message
from nemo_gym_checkpoint_plugin.builtin_participants.model.cut_stream import (
    Generation,
    WorkerStreamError,
    worker_stream,
)

__all__ = ["ContinuationFailed", "continue_chat", "seed_generation"]

# What the continuation sends itself, whatever the chat request said about them.
_OWN = ("logprobs", "top_logprobs", "return_token_ids", "max_tokens", "max_completion_tokens")


class ContinuationFailed(RuntimeError):
    """The worker could not continue the cut (the call is generated from scratch instead)."""


def seed_generation(generation: Generation, cut: Mapping[str, Any]) -> list[int]:
    """Start ``generation`` (the re-sent call's) from the restored ``cut``: its prompt and its prefix.

    Returns the prompt's token ids (what ``generation.prompt_token_ids`` now holds)."""
    prompt = generation.prompt_token_ids = list(cut["prompt_token_ids"])
    generation.token_ids = list(cut["token_ids"])
    generation.logprobs = list(cut["logprobs"])
    generation.response = dict(cut["response"])
    generation.reasoning_field = cut.get("reasoning_field") or "reasoning"
    generation.continued_from = len(cut["token_ids"])
    if "stop_reason" in cut:
        generation.stop_reason = (cut["stop_reason"],)
    if cut.get("finish_reason") is not None:
        # Finished: the whole message is in the cut.
        generation.content = [cut.get("text") or ""]
        generation.reasoning = [cut["reasoning"]] if cut.get("reasoning") else []
        generation.tool_calls = {i: dict(call) for i, call in enumerate(cut.get("tool_calls") or [])}
        generation.finish_reason = cut["finish_reason"]
    return prompt


def _chat_logprob(token: str, logprob: float) -> dict[str, Any]:
    # vLLM's own conversion of a sampled token for the chat API (the top alternatives: none, top_logprobs 0).
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode("utf-8", errors="replace")),
        "top_logprobs": [],
    }


def _limit(body: Mapping[str, Any]) -> int | None:
    for field in ("max_completion_tokens", "max_tokens"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


async def _detokenize(client: Any, model: Any, tokens: list[int]) -> str:
    if not tokens:
        return ""
    request = {"url": f"{client.base_url.removesuffix('/v1')}/detokenize", "json": {"model": model, "tokens": tokens}}
    response = await client._request(method="POST", **request)  # Gym's NeMoGymAsyncOpenAI transport (0.7.x)
    try:
        await client._raise_for_status(response, request)
        answer = orjson.loads(await response.read())
        text = answer.get("prompt") if isinstance(answer, dict) else None
    finally:
        response.release()
    if not isinstance(text, str):
        raise ContinuationFailed("the worker's /detokenize answered no prompt text")
    return text


async def continue_chat(
    client: Any,
    body: Mapping[str, Any],
    cut: Mapping[str, Any],
    generation: Generation,
    *,
    reasoning: bool,
    tool_parser: str | None,
) -> dict[str, Any]:
    """The whole answer to ``body`` from ``cut``'s prefix and the worker's remainder (see the module docstring)."""
    prompt = seed_generation(generation, cut)
    if generation.finish_reason is not None:
        return generation.assemble(body)
    limit = _limit(body)
    remaining = None if limit is None else limit - len(generation.token_ids)
    request: dict[str, Any] = {
        **{k: v for k, v in cut["sampling"].items() if k not in _OWN},
        "model": body.get("model"),
        "prompt": prompt + generation.token_ids,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "logprobs": 0,
    }
    if remaining is not None:
        request["max_tokens"] = remaining
    text: list[str] = []
    finish: str | None = None
    try:
        prefix = await _detokenize(client, body.get("model"), generation.token_ids)
        generation.content = [prefix]  # raw text while it continues: what a cut of this call then says
        if remaining is not None and remaining <= 0:
            finish = "length"
        else:
            async for chunk in worker_stream(client, "/completions", request):
                finish = _add_completion_chunk(generation, chunk, text) or finish
    except (ClientError, WorkerStreamError, KeyError, TypeError, ValueError, orjson.JSONDecodeError) as exc:
        raise ContinuationFailed(f"{type(exc).__name__}: {exc}") from exc
    if finish is None:
        raise ContinuationFailed("the worker's stream ended before the generation finished")
    tools = bool(body.get("tools")) and body.get("tool_choice") != "none" and tool_parser is not None
    known_ids = [call.get("id") for call in cut.get("tool_calls") or () if isinstance(call.get("id"), str)]
    message = parse_message(
        prefix + "".join(text),
        reasoning=reasoning,
        tools=tools,
        reasoning_field=generation.reasoning_field,
        known_ids=known_ids,
    )
    # The parsed message becomes the generation's before it says finished: a cut of it then holds the answer.
    generation.content = [message.get("content") or ""]
    generation.reasoning = [message[generation.reasoning_field]] if message.get(generation.reasoning_field) else []
    generation.tool_calls = dict(enumerate(message.get("tool_calls") or []))
    generation.finish_reason = "tool_calls" if message.get("tool_calls") else finish
    return generation.assemble(body, message)


def _add_completion_chunk(generation: Generation, chunk: Any, text: list[str]) -> str | None:
    if not isinstance(chunk, dict) or "error" in chunk:
        raise WorkerStreamError(f"the worker's stream ended with an error: {chunk}")
    finish = None
    for choice in chunk.get("choices") or ():
        if choice.get("index", 0) != 0:
            continue
        ids = choice.get("token_ids") or []
        logprobs = choice.get("logprobs") or {}
        tokens, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
        if len(tokens) != len(ids) or len(values) != len(ids):
            raise WorkerStreamError("a continuation chunk's token ids and logprobs differ in length")
        if choice.get("text"):
            text.append(choice["text"])
            generation.content.append(choice["text"])
        generation.token_ids.extend(ids)
        generation.logprobs.extend(_chat_logprob(t, v) for t, v in zip(tokens, values, strict=True))
        if "stop_reason" in choice:
            generation.stop_reason = (choice["stop_reason"],)
        finish = choice.get("finish_reason") or finish
    return finish
