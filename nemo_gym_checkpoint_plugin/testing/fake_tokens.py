"""The fake backend's tokenizer and chat template: deterministic token ids, decodable as a real tokenizer's are.

Gym's ``vllm_model`` with ``return_token_id_information: true`` asks for per-token logprobs
(``return_tokens_as_token_ids``) and training-token capture needs them; a model server that cuts
generations asks for token ids (``return_token_ids``), sends token-id prompts to
``/v1/completions`` and decodes token ids (``/detokenize``). So the fake tokenizes as vLLM's does:

- a **word** (whitespace-separated) is one token, its id derived from the word alone (stable across
  processes): the numbered words of long answers (``word<N>``, ``thought<N>``) get ids of their own,
  every other word a hash (two words may share one, as rarely as 2**31 ids make it). The backend's
  ``Vocabulary`` remembers every word it gave an id, so it decodes any id it produced since it
  started (a restarted backend refuses ids from before, as a worker with another tokenizer would);
- the **chat template** renders the request's tools (a header) and every message in turn, then a
  generation prompt; an assistant message in a later prompt renders as the generation prompt, the
  tokens generated for it and an end token. Each call's prompt + generation is then a prefix of the
  next call's prompt, which Gym's trajectory builder checks;
- what the model **generates** for an assistant message is its raw text, one token per word, then the
  end token (a special token: no text). The raw text is its reasoning in ``<think> ... </think>``
  (when it has any), its content, then each tool call as ``<tool_call> {"id", "name", "arguments"}
  </tool_call>`` (the Hermes format, plus the call's id: the id makes every call of a multi-call turn
  generate its own tokens). A worker's tool-call and reasoning parsers turn that raw text back into
  the message (``fake_generation.py`` streams it as such).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

__all__ = [
    "END",
    "GENERATION_PROMPT",
    "Vocabulary",
    "assistant_words",
    "decode_prompt",
    "logprob_at",
]

_ROLES = {"system": 1, "developer": 2, "user": 3, "assistant": 4, "tool": 5}
_ROLE_OF = {token: role for role, token in _ROLES.items()}
_OTHER_ROLE = 6
GENERATION_PROMPT = 10
END = 11
_TOOLS = 12
_SPECIAL = frozenset({*_ROLES.values(), _OTHER_ROLE, GENERATION_PROMPT, END, _TOOLS})
# Word ids live above the special tokens: numbered words below 2**24, every other word hashed above it.
_NUMBERED = re.compile(r"(word|thought)([0-9]{1,7})")
_NUMBERED_BASE = 100
_HASHED_BASE = 2**24
_HASHED_SPACE = 2**31 - _HASHED_BASE - 1


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def logprob_at(position: int, token: int) -> float:
    """The logprob the fake reports for ``token`` generated at ``position``: varies with both, so a
    continuation that misplaces a token shows."""
    return -round(0.001 + ((token * 31 + position * 17) % 997) / 1000, 6)


class Vocabulary:
    """Word <-> token id of one backend process (ids are a function of the word; this remembers them)."""

    def __init__(self) -> None:
        self._words: dict[int, str] = {}

    def token(self, word: str) -> int:
        numbered = _NUMBERED.fullmatch(word)
        if numbered is not None and not (len(numbered.group(2)) > 1 and numbered.group(2)[0] == "0"):
            token = _NUMBERED_BASE + 2 * int(numbered.group(2)) + (numbered.group(1) == "thought")
        else:
            token = _HASHED_BASE + int(hashlib.sha256(word.encode()).hexdigest()[:12], 16) % _HASHED_SPACE
        # Two hashed words sharing an id decode as the first one seen (ids stay a function of the word).
        self._words.setdefault(token, word)
        return token

    def tokens(self, text: str) -> list[int]:
        return [self.token(word) for word in text.split()]

    def word(self, token: int) -> str:
        """The text of ``token`` (a special token has none); ``KeyError`` for an id this process never made."""
        if token in _SPECIAL:
            return ""
        return self._words[token]

    def text(self, tokens: list[int]) -> str:
        """The decoded text of ``tokens``: their words, one space apart (special tokens have no text)."""
        return " ".join(word for word in (self.word(t) for t in tokens) if word)

    def prompt_length(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
        """How many tokens ``render`` makes of the prompt (without giving its words ids)."""
        length = 2 + len(json.dumps(tools, sort_keys=True).split()) if tools else 0
        for message in messages:
            if message.get("role") == "assistant":
                length += 2 + len(assistant_words(message))
            else:
                length += 2 + len(_content(message.get("content")).split())
        return length + 1

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat template: the tools header, every message, then the generation prompt."""
        rendered: list[int] = []
        if tools:
            rendered += [_TOOLS, *self.tokens(json.dumps(tools, sort_keys=True)), END]
        for message in messages:
            role = message.get("role")
            if role == "assistant":
                rendered += [GENERATION_PROMPT, *self.tokens(" ".join(assistant_words(message))), END]
            else:
                rendered += [_ROLES.get(str(role), _OTHER_ROLE), *self.tokens(_content(message.get("content"))), END]
        return rendered + [GENERATION_PROMPT]


def _reasoning(message: dict[str, Any]) -> str:
    for field in ("reasoning", "reasoning_content"):
        if isinstance(message.get(field), str) and message[field]:
            return message[field]
    return ""


def assistant_words(message: dict[str, Any]) -> list[str]:
    """The words the model generates for an assistant message (its raw text), the end token aside."""
    words: list[str] = []
    reasoning = _reasoning(message)
    if reasoning:
        words += ["<think>", *reasoning.split(), "</think>"]
    words += _content(message.get("content")).split()
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:
            arguments = str(function.get("arguments"))
        block = json.dumps({"id": call.get("id"), "name": function.get("name"), "arguments": arguments})
        words += ["<tool_call>", *block.split(), "</tool_call>"]
    return words


def decode_prompt(vocabulary: Vocabulary, tokens: list[int]) -> tuple[list[dict[str, Any]], list[Any], list[int]]:
    """``(messages, tools, generated)`` of a token-id prompt this template rendered, plus any tokens after it.

    ``generated`` is what follows the last generation prompt (a partial answer to continue). The
    messages carry what decides the fake's answer: roles, text, one assistant message per earlier
    call. ``ValueError`` for ids this process never made or a prompt it did not render.
    """
    try:
        last = len(tokens) - 1 - tokens[::-1].index(GENERATION_PROMPT)
    except ValueError:
        raise ValueError("the prompt has no generation prompt: the fake's chat template did not render it") from None
    body, generated = tokens[:last], tokens[last + 1 :]
    messages: list[dict[str, Any]] = []
    tools: list[Any] = []
    i = 0
    try:
        while i < len(body):
            start = body[i]
            end = body.index(END, i + 1)
            words = vocabulary.text(body[i + 1 : end])
            if start == _TOOLS:
                tools = json.loads(words)
            elif start == GENERATION_PROMPT:
                messages.append({"role": "assistant", "content": words})
            else:
                messages.append({"role": _ROLE_OF.get(start, "other"), "content": words})
            i = end + 1
    except KeyError as exc:
        raise ValueError(f"token id {exc.args[0]} is not in this fake backend's vocabulary") from None
    except ValueError as exc:
        raise ValueError(f"the prompt is not one the fake's chat template rendered ({exc})") from None
    return messages, tools, generated
