"""Token ids for the fake backend's answers, as vLLM returns them when asked (``logprobs`` requested).

Gym's ``vllm_model`` with ``return_token_id_information: true`` asks vLLM for
``return_tokens_as_token_ids`` and per-token logprobs; training-token capture needs them.
The fake tokenizer is deterministic and chat-shaped, so the calls of one turn chain the way a
real chat template makes them chain: a prompt is every message rendered in turn plus a
generation prompt, and an assistant message in a later prompt renders as that generation
prompt, the tokens generated for it, and an end token. Each call's prompt + generation is then
a prefix of the next call's prompt, which Gym's trajectory builder checks.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["token_fields"]

_ROLES = {"system": 1, "developer": 2, "user": 3, "assistant": 4, "tool": 5}
_GENERATION_PROMPT = 10
_END = 11


def _word(word: str) -> int:
    return 100 + int(hashlib.sha256(word.encode()).hexdigest()[:6], 16) % 50_000


def _words(text: str) -> list[int]:
    return [_word(w) for w in text.split()]


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _assistant_body(message: dict[str, Any]) -> list[int]:
    """What the model generated for an assistant message: its text, then each tool call (its id, name and
    canonical arguments: the id makes every call of a multi-call turn generate its own tokens)."""
    tokens = _words(_content(message.get("content")))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        try:
            arguments = json.dumps(json.loads(function.get("arguments") or "{}"), sort_keys=True, separators=(",", ":"))
        except ValueError:
            arguments = str(function.get("arguments"))
        tokens += [_word("<tool_call>"), _word(str(call.get("id"))), _word(str(function.get("name"))),
                   *_words(arguments)]
    return tokens + [_END]


def _prompt(messages: list[dict[str, Any]]) -> list[int]:
    tokens: list[int] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            tokens += [_GENERATION_PROMPT, *_assistant_body(message)]
        else:
            tokens += [_ROLES.get(str(role), 6), *_words(_content(message.get("content"))), _END]
    return tokens + [_GENERATION_PROMPT]


def token_fields(messages: list[dict[str, Any]], answer: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """``(prompt_token_ids, choice fields)`` for ``answer`` (the generated assistant message)."""
    generated = _assistant_body(answer)
    logprobs = {"content": [{"token": f"token_id:{t}", "logprob": -0.5, "bytes": None, "top_logprobs": []}
                            for t in generated]}
    return _prompt(messages), {"token_ids": generated, "logprobs": logprobs}
