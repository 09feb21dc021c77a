"""How the CLI shows things: tables that fit the terminal (rich), JSON for scripts, errors once.

Tables are rendered by ``rich`` at the terminal's width (80 columns when stdout is not a
terminal), wrapping long cells instead of running past the edge; cells are ``Text`` so a
value like ``[x]`` is shown as it is, never read as markup. Colour only on a terminal.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import orjson
from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["console", "print_error", "print_json", "table", "words"]

FALLBACK_WIDTH = 80


def console(stream: TextIO) -> Console:
    """A rich console on ``stream``: the terminal's width there, else 80 columns (or ``COLUMNS``)."""
    width = None if stream.isatty() or os.environ.get("COLUMNS") else FALLBACK_WIDTH
    return Console(file=stream, width=width, highlight=False, soft_wrap=False, emoji=False, markup=False)


def table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], *, wrap: Sequence[str] = (), width: int | None = None
) -> str:
    """A table with no borders; ``None`` shows as ``-``; only the ``wrap`` columns may wrap.

    Returns the text (for a terminal, styled); ``width`` defaults to stdout's console width.
    """
    grid = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for header in headers:
        grid.add_column(header, no_wrap=header not in wrap, overflow="fold")
    for row in rows:
        grid.add_row(*(Text("-" if cell is None else str(cell)) for cell in row))
    target = console(sys.stdout)
    buffer = io.StringIO()
    render = Console(
        file=buffer,
        width=width or target.width,
        highlight=False,
        markup=False,
        emoji=False,
        # rich types the property as str and the argument as a Literal of the very names it returns.
        color_system=target.color_system,  # type: ignore[arg-type]
        force_terminal=target.is_terminal,
    )
    render.print(grid)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


def words(values: Sequence[Any], *, limit: int = 10, none: str = "none") -> str:
    """A list for a sentence: ``a, b, c`` (``and N more`` past ``limit``), never a Python repr."""
    values = [str(v) for v in values]
    if not values:
        return none
    shown = ", ".join(values[:limit])
    return shown + (f" and {len(values) - limit} more" if len(values) > limit else "")


def print_json(value: Any, stream: TextIO | None = None, *, compact: bool = False) -> None:
    stream = stream or sys.stdout
    option = orjson.OPT_SORT_KEYS if compact else orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS
    stream.write(orjson.dumps(value, option=option).decode() + "\n")
    stream.flush()


def print_error(command: str, message: str, *, as_json: bool, code: str, **details: Any) -> None:
    """One error, once: with ``--json`` a document ``{"error": {"code", "detail", ...details}}`` on
    stdout (nothing on stderr), else ``ng-checkpoint CMD: error: ...`` on stderr."""
    if as_json:
        print_json({"error": {"code": code, "detail": message, **details}})
    else:
        print(f"ng-checkpoint {command}: error: {message}", file=sys.stderr)
