"""Parse a continued generation's whole raw text as the worker's parsers parse an uninterrupted one.

A continuation (``cut_continue.py``) asks the worker for the rest of a generation on
``/v1/completions``, which returns raw text: no reasoning or tool-call parsing. The model server
then parses the prefix and the remainder joined, as a whole, the way a vLLM worker with these
server options parses a chat answer (docs/protocol.md, "Generation cuts"):

- a reasoning parser (Gym's ``uses_reasoning_parser: true``; vLLM's ``qwen3`` and ``deepseek_r1``
  agree on this): an optional leading ``<think>``; the text up to ``</think>`` is the reasoning,
  what follows the content (``None`` when empty). Without ``</think>``: a text that opened
  ``<think>`` is all reasoning (cut short while thinking), any other all content;
- ``--tool-call-parser hermes`` (``tool_call_parser: hermes``), for a call offering tools: each
  ``<tool_call> {"name": ..., "arguments": {...}} </tool_call>`` block is a tool call (an unclosed
  last block counts), the text before the first block the content (``None`` when empty). A block
  that is not such JSON leaves the whole text as content and no tool calls, as vLLM does. A
  block's own ``"id"`` (which a model may generate) is its call id; otherwise the prefix's
  streamed id of that call, else a new ``chatcmpl-tool-<hex>`` id, as vLLM makes them.

No stripping anywhere: vLLM's parsers keep the text as generated.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

__all__ = ["parse_message"]

_THINK, _END_THINK = "<think>", "</think>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def _split_reasoning(text: str) -> tuple[str | None, str | None]:
    opened = text.startswith(_THINK)
    if opened:
        text = text[len(_THINK) :]
    if _END_THINK not in text:
        return (text or None, None) if opened else (None, text or None)
    reasoning, _, content = text.partition(_END_THINK)
    return reasoning or None, content or None


def _tool_calls(text: str, known_ids: list[str]) -> tuple[str | None, list[dict[str, Any]]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text or None, []
    calls = []
    for index, match in enumerate(_BLOCK.finditer(text)):
        try:
            block = json.loads(match.group(1) if match.group(1) is not None else match.group(2))
            name, arguments = block["name"], block.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return text or None, []
        if not isinstance(name, str):
            return text or None, []
        call_id = block.get("id") if isinstance(block.get("id"), str) else None
        if call_id is None:
            call_id = known_ids[index] if index < len(known_ids) else f"chatcmpl-tool-{uuid.uuid4().hex}"
        calls.append(
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
            }
        )
    return text[:start] or None, calls


def parse_message(
    text: str, *, reasoning: bool, tools: bool, reasoning_field: str = "reasoning", known_ids: list[str] | None = None
) -> dict[str, Any]:
    """The assistant message of raw generated ``text``, as the configured parsers make it."""
    thought, content = _split_reasoning(text) if reasoning else (None, text or None)
    calls: list[dict[str, Any]] = []
    if tools and content is not None:
        content, calls = _tool_calls(content, known_ids or [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thought is not None:
        message[reasoning_field] = thought
    if calls:
        message["tool_calls"] = calls
    return message
