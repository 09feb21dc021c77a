"""What the fake backend answers, token by token: the raw text it generates and how a worker's parsers see it.

The answer depends only on the conversation (the first ``user`` message's text, where tests put
the rollout id), the step (assistant messages already in the request) and the tool results:

- fewer ``tool`` messages than the turn's tool rounds and the request offers tools: one call of
  the first tool (``finish_reason: "tool_calls"``), with arguments filled from its JSON schema
  (``city`` is ``"San Francisco"``, other strings ``"x"``), which earns ``example_single_tool_call``
  its reward 1.0. A turn has one tool round, or N when its conversation contains
  ``[tool_rounds=N]``;
- otherwise a final text answer (``finish_reason: "stop"``): one sentence, followed by N more words
  when the conversation contains ``[answer_words=N]`` (a long generation: with N = 1992 the answer
  is 2,000 tokens, the end token included), preceded by ``<think>`` and N words of reasoning when it
  contains ``[reasoning_words=N]``.

``Answer`` holds the generated tokens (one per word of the raw text, then the end token) and the
text each token adds (``pieces``). ``Deltas`` turns pieces into what a vLLM worker started with
``--tool-call-parser hermes`` (and, when the backend parses reasoning, ``--reasoning-parser
deepseek_r1``) streams: content and reasoning text, and a tool call once its block closed. The
whole answer's message is those deltas assembled, so a streamed and a whole answer agree.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from .fake_tokens import END, Vocabulary, assistant_words

__all__ = ["FINAL_ANSWER", "Answer", "Deltas", "answer_for", "conversation_of", "tool_rounds"]

_ROUNDS = re.compile(r"\[tool_rounds=(\d+)\]")
_ANSWER_WORDS = re.compile(r"\[answer_words=(\d+)\]")
_REASONING_WORDS = re.compile(r"\[reasoning_words=(\d+)\]")
FINAL_ANSWER = "It is cold in San Francisco today."


def _text(content: Any) -> str:
    """The text of a chat message's content, whether a string or a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def conversation_of(messages: list[dict[str, Any]]) -> tuple[str, int]:
    """``(conversation, step)`` of a chat request: first user text, count of assistant messages."""
    users = [m for m in messages if m.get("role") == "user"]
    conversation = _text(users[0].get("content")) if users else ""
    step = sum(1 for m in messages if m.get("role") == "assistant")
    return conversation, step


def tool_rounds(conversation: str) -> int:
    """How many tool calls a turn of ``conversation`` makes before its answer (``[tool_rounds=N]``, else 1)."""
    found = _ROUNDS.search(conversation)
    return int(found.group(1)) if found else 1


def _arguments_for(schema: dict[str, Any]) -> dict[str, Any]:
    properties = schema.get("properties") or {}
    arguments: dict[str, Any] = {}
    for name in schema.get("required") or list(properties):
        kind = (properties.get(name) or {}).get("type")
        if name == "city":
            arguments[name] = "San Francisco"
        elif kind in ("integer", "number"):
            arguments[name] = 1
        elif kind == "boolean":
            arguments[name] = True
        else:
            arguments[name] = "x"
    return arguments


def _raw_message(messages: list[dict[str, Any]], tools: list[Any], conversation: str, step: int) -> dict[str, Any]:
    """The assistant message the fake model generates (reasoning in its own field, before any parser)."""
    functions = [t for t in tools or [] if isinstance(t, dict) and t.get("type") == "function"]
    tool_results = sum(1 for m in messages if m.get("role") == "tool")
    if functions and tool_results < tool_rounds(conversation):
        function = functions[0]["function"]
        # Stable across processes (unlike hash()), so a replayed step gets the same call id.
        call_id = "call_" + hashlib.sha256(f"{step}:{conversation}".encode()).hexdigest()[:16]
        arguments = json.dumps(_arguments_for(function.get("parameters") or {}))
        call = {"id": call_id, "type": "function", "function": {"name": function["name"], "arguments": arguments}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    extra = _ANSWER_WORDS.search(conversation)
    words = " ".join(f"word{i}" for i in range(int(extra.group(1)))) if extra else ""
    message: dict[str, Any] = {"role": "assistant", "content": f"{FINAL_ANSWER} {words}".rstrip()}
    reasoning = _REASONING_WORDS.search(conversation)
    if reasoning:
        message["reasoning"] = " ".join(f"thought{i}" for i in range(int(reasoning.group(1))))
    return message


@dataclass
class Answer:
    """One answer: the text each token adds, the tool calls it makes, its token ids (the end token last).

    The ids are given only when asked for (``tokens``): most calls of a big run never need them.
    """

    vocabulary: Vocabulary
    words: list[str]
    pieces: list[str]
    tool_calls: list[dict[str, Any]]
    _tokens: list[int] | None = None

    @property
    def tokens(self) -> list[int]:
        if self._tokens is None:
            self._tokens = [*(self.vocabulary.token(word) for word in self.words), END]
        return self._tokens

    def __len__(self) -> int:
        return len(self.pieces)


def answer_for(
    vocabulary: Vocabulary, messages: list[dict[str, Any]], tools: list[Any], conversation: str, step: int
) -> Answer:
    raw = _raw_message(messages, tools, conversation, step)
    words = assistant_words(raw)
    pieces = [word if i == 0 else f" {word}" for i, word in enumerate(words)] + [""]
    return Answer(vocabulary=vocabulary, words=words, pieces=pieces, tool_calls=list(raw.get("tool_calls") or ()))


@dataclass
class Deltas:
    """The parsers' state over one answer's pieces: what each new token adds to the streamed message."""

    answer: Answer
    reasoning_parser: bool
    _mode: str = "content"
    _tool_text: list[str] = field(default_factory=list)
    _calls: int = 0

    def delta(self, position: int) -> dict[str, Any]:
        """The chat ``delta`` for the token at ``position`` (empty: a parser held it back)."""
        piece = self.answer.pieces[position]
        word = piece.lstrip(" ")
        space = piece[: len(piece) - len(word)]
        if self._mode == "tool":
            self._tool_text.append(piece)
            if word != "</tool_call>":
                return {}
            self._mode = "content"
            self._tool_text = []
            call = self.answer.tool_calls[self._calls]
            self._calls += 1
            return {
                "tool_calls": [
                    {"index": self._calls - 1, "id": call["id"], "type": "function", "function": dict(call["function"])}
                ]
            }
        if self.reasoning_parser and position == 0 and word == "<think>":
            self._mode = "reasoning"
            return {}
        if self._mode == "reasoning":
            if word == "</think>":
                self._mode = "content"
                return {"reasoning": space} if space else {}
            return {"reasoning": piece} if piece else {}
        if word == "<tool_call>":
            self._mode = "tool"
            self._tool_text = [piece]
            return {"content": space} if space else {}
        return {"content": piece} if piece else {}

    def unfinished(self) -> dict[str, Any]:
        """At a cut-short end inside a tool block, its text is content (Hermes: a block that does not parse)."""
        text = "".join(self._tool_text)
        self._tool_text = []
        return {"content": text} if text else {}


def message_of(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole message the deltas stream (what a non-streamed answer carries)."""
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    calls = [call for d in deltas for call in d.get("tool_calls", ())]
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in calls]
    return message
