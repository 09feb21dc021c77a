"""How the CLI shows things: plain tables, a progress line per reply, JSON for scripts."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TextIO

import orjson

from ..coordination import Progress

__all__ = ["ProgressPrinter", "print_json", "table"]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A left-aligned text table; ``None`` shows as ``-``."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def print_json(value: Any, stream: TextIO | None = None) -> None:
    stream = stream or sys.stdout
    stream.write(orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode() + "\n")


class ProgressPrinter:
    """One line on stderr per participant reply of a fan-out: ``[done/total] kind name ok 0.03s``."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr

    def __call__(self, event: Progress) -> None:
        who = f"{event.participant.kind:<11} {event.participant.name}"
        if event.failure is None:
            outcome = "ok"
            phase = (event.reply or {}).get("phase")
            if phase:
                outcome += f" ({phase})"
        else:
            outcome = f"FAILED {event.failure.code}: {event.failure.detail}"
        width = len(str(event.total))
        self.stream.write(
            f"  [{event.done:>{width}}/{event.total}] {event.operation:<8} {who}  {outcome}  {event.elapsed:.2f}s\n"
        )
        self.stream.flush()
