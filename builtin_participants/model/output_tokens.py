"""The output tokens of a model call, read from the usage its answer reports (the lost-work ledger's tokens).

The model server's answer is JSON passing through the held-responses middleware as bytes; rather than
parse it a second time, each body chunk is scanned for the usage's count: ``"output_tokens": N``
(``/v1/responses``) or ``"completion_tokens": N`` (chat completions). The last one seen wins, so an
event stream's in-progress events are superseded by its final one (``response.completed``, or a chat
stream's usage chunk with ``stream_options.include_usage``). A key is matched only whole and unescaped:
``"max_output_tokens"``, ``"output_tokens_details"`` and the text of a message (whose quotes are
escaped) never match. A chunk boundary inside a count is covered by keeping the end of the previous
chunk.

Not counted: an answer that reports no usage (an event stream without its usage event, a backend that
leaves it out), and a call whose answer is held at a checkpoint while streaming (its usage comes in a
later event, which waits behind the held first one).
"""

from __future__ import annotations

import re

__all__ = ["UsageScan"]

_COUNT = re.compile(rb'"(?:output_tokens|completion_tokens)"\s*:\s*([0-9]+)')
_MARK = b'_tokens"'
# Longer than any match: a key and its count split across two chunks is found in the joined bytes.
_TAIL = 64


class UsageScan:
    """The output tokens one answer reports so far (``tokens``; None: none yet), fed its body chunks in order."""

    __slots__ = ("_tail", "tokens")

    def __init__(self) -> None:
        self._tail = b""
        self.tokens: int | None = None

    def feed(self, chunk: bytes) -> bool:
        """Scan the next chunk; True when ``tokens`` changed."""
        if not chunk:
            return False
        data = self._tail + chunk if self._tail else chunk
        self._tail = data[-_TAIL:]
        if _MARK not in data:
            return False
        counts = _COUNT.findall(data)
        if not counts:
            return False
        tokens = int(counts[-1])
        if tokens == self.tokens:
            return False
        self.tokens = tokens
        return True
