"""Faithful JSON lines for checkpoint records.

A record must come back exactly: key order, NaN and infinities, and integers
beyond 64 bits. orjson is used first (it is the fast path and keeps key order);
it cannot encode integers beyond 64 bits and it silently writes NaN and the
infinities as ``null``. So where orjson raised, or where a walk of the record's
containers finds a NaN or an infinity, the record is encoded by the standard
library instead, which writes ``NaN``/``Infinity``/``-Infinity`` and exact big
integers. Decoding mirrors it: orjson first, the standard library
for the lines orjson refuses.

Values that are not JSON (a ``datetime``, a ``set``, a dataclass, bytes) are
refused rather than coerced, so what is restored is what was exported.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

__all__ = ["NotJSON", "encode_line", "encode_record", "decode_line"]

# Send orjson's non-JSON conveniences to ``default`` (which refuses them).
_OPTIONS = (
    orjson.OPT_APPEND_NEWLINE
    | orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_SUBCLASS
)


class NotJSON(TypeError):
    """The record holds a value JSON cannot represent faithfully."""


def _refuse(value: Any) -> Any:
    raise NotJSON(f"{type(value).__name__} is not a JSON value: {value!r:.80}")


_NUMBER_TYPES = (int, float)
# A byte search (for "null", for long digit runs) costs about as much per byte as a walk of the
# decoded record costs per item every this many bytes: the walks run first within that budget. Measured
# on this 2-core machine: a search about 0.6 ns a byte, a walk 60-120 ns an item (an agent's 1.9 KB
# record of 43 items is decided sooner by the search: 64 here walked 29 of them first, doubling the
# encoder's and the decoder's time for it; a 350 KB record of long strings and number lists is still
# decided by its walk of a few hundred items).
_BYTES_PER_ITEM = 256


def _needs_fallback(value: Any, budget: int | None = None) -> bool | None:
    """True when orjson would have changed the value: a NaN or infinity somewhere.

    Walks containers only, scalars inline; a list of plain numbers (token ids, logprobs) is
    checked in one C-level pass, so the cost follows the record's structure, not its size in bytes.
    With a ``budget`` (of containers and scalars looked at), ``None`` once it is spent: undecided.
    """
    kind = type(value)
    if kind is float:
        return not math.isfinite(value)
    if kind is not dict and kind is not list and kind is not tuple:
        return False
    stack = [value]
    pop, push, isfinite = stack.pop, stack.append, math.isfinite
    left = -1 if budget is None else budget
    while stack:
        item = pop()
        left -= len(item)
        if left < 0 and budget is not None:
            return None
        for child in item.values() if type(item) is dict else item:
            kind = type(child)
            if kind is str or child is None or kind is int or kind is bool:
                continue
            if kind is float:
                if not isfinite(child):
                    return True
            elif kind is list or kind is tuple:
                if not (child and type(child[0]) in _NUMBER_TYPES and _all_finite_numbers(child)):
                    push(child)
            elif kind is dict:
                push(child)
    return False


def _all_finite_numbers(items: list[Any] | tuple[Any, ...]) -> bool:
    """True when every item is a number and none is NaN or infinite; False means "look closer".

    ``sum`` propagates NaN and infinities (float addition keeps them; its compensation term
    is dropped when not finite), so a finite sum proves every term finite. It raises for
    non-numbers (TypeError), and ``isfinite`` for an integer sum too large for a float
    (OverflowError); a sum that overflows to infinity is merely "look closer": those lists
    are walked item by item.
    """
    try:
        return math.isfinite(sum(items))
    except (TypeError, ValueError, OverflowError):
        return False


def _check_plain(value: Any) -> None:
    """Refuse what the standard library would coerce or cannot encode (walked only on the slow path)."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is dict:
            for key in item:
                if type(key) is not str:
                    raise NotJSON(f"object key {key!r:.80} is not a string")
            stack.extend(item.values())
        elif kind is list or kind is tuple:
            stack.extend(item)
        elif item is None or kind in (str, int, float, bool):
            continue
        else:
            _refuse(item)


def _stdlib_line(value: Any) -> bytes:
    _check_plain(value)
    text = json.dumps(value, ensure_ascii=False, allow_nan=True, separators=(",", ":"))
    try:
        return text.encode("utf-8") + b"\n"
    except UnicodeEncodeError as exc:
        raise NotJSON(f"a string holds {exc.object[exc.start : exc.end]!r}, which is not valid Unicode") from None


def encode_record(value: Any) -> tuple[bytes, bool]:
    """``(line, exact)``: one JSON line (newline included), and whether only the exact reader decodes
    it faithfully (it holds an integer beyond 64 bits, NaN or an infinity).

    Raises ``NotJSON`` naming the offending value when the record is not plain JSON.
    """
    try:
        line = orjson.dumps(value, default=_refuse, option=_OPTIONS)
    except orjson.JSONEncodeError as exc:
        if isinstance(exc.__cause__, NotJSON):
            raise exc.__cause__ from None
        # Integers beyond 64 bits (and nothing else) are what the standard library adds.
        return _stdlib_line(value), True
    # orjson writes NaN and the infinities as null. The walk of the record's containers costs less
    # than a search of its bytes for that token unless it holds many small containers and scalars
    # for its size: past a budget of one item per _BYTES_PER_ITEM bytes, the search decides first
    # (a line without "null" holds no NaN nor infinity), then the whole walk.
    fallback = _needs_fallback(value, len(line) // _BYTES_PER_ITEM)
    if fallback is None:
        fallback = b"null" in line and bool(_needs_fallback(value))
    if fallback:
        return _stdlib_line(value), True
    return line, False


def encode_line(value: Any) -> bytes:
    """One JSON line (newline included) that ``decode_line`` turns back into an equal value."""
    return encode_record(value)[0]


# orjson reads an integer beyond 64 bits as a float, silently. Such an integer is written as a run
# of at least 19 digits not after a "." (only a fraction's digits follow a "."; a fraction may
# have that many, leading zeros included, as in 0.00030000000000000003). Digits map to "0", "."
# to itself, everything else to " " (whatever precedes an integer: "[", ",", ":", "-", a space),
# and C-level substring searches find the runs and look at what precedes each. Most lines have
# none (a pass or two over the bytes, in C). A decoded record holding no number of magnitude
# 2**63 or more cannot have lost one (the walk checks a list of numbers in one C-level
# ``math.hypot`` pass, which is at least the largest magnitude in it); one that holds such a
# number is read exactly. The walk's cost follows the record's items, the screen's its bytes:
# the walk runs first within a budget of items for the line's length (a record of long strings
# and number lists, an agent's, is decided there at a fraction of the screen's cost); past it,
# the screen, and the whole walk only for a line with such a run.
_HUGE = float(2**63)
_DIGITS_ONLY = bytes(0x30 if 0x30 <= b <= 0x39 else b if b == 0x2E else 0x20 for b in range(256))
_LONG_RUN = b"0" * 19
_DOT = ord(".")


def _long_integer_run(line: bytes) -> bool:
    """True when ``line`` has a run of 19 digits or more not after a "." (maybe an integer beyond 64 bits)."""
    digits = line.translate(_DIGITS_ONLY)
    start = digits.find(_LONG_RUN)
    while start != -1:
        # The leftmost match starts a run (unless inside a fraction of 38 digits or more: then this
        # says True, and the walk decides). A run after no "." may be an integer.
        if start == 0 or digits[start - 1] != _DOT:
            return True
        # A fraction's run: the next run starts after it ends, at least 19 digits on.
        start = digits.find(_LONG_RUN, start + 19)
    return False


def _holds_huge_number(value: Any, budget: int | None = None) -> bool | None:
    """True when a number of magnitude 2**63 or more is somewhere in ``value`` (orjson's output).

    With a ``budget`` (of items looked at), ``None`` once it is spent: undecided.
    """
    stack = [value]
    left = -1 if budget is None else budget
    while stack:
        item = stack.pop()
        left -= 1
        if left < 0 and budget is not None:
            return None
        kind = type(item)
        if kind is float or kind is int:
            if not -_HUGE < item < _HUGE:
                return True
        elif kind is dict:
            stack.extend(item.values())
        elif kind is list:
            try:
                if math.hypot(*item) < _HUGE:
                    continue
            except (TypeError, ValueError, OverflowError):
                pass  # not all numbers (or too large for a float): item by item
            stack.extend(item)
    return False


def decode_line(line: bytes) -> Any:
    """Decode one record line written by ``encode_line``; raises ``ValueError`` when it is not JSON.

    Every line is screened for integers beyond 64 bits: nothing a digest covers could tell
    the reader that a file holds none (a manifest extra saying so was dropped for that reason).
    """
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        # NaN and Infinity tokens: only the standard library reads them.
        return json.loads(line)
    # A walk of the decoded record within a budget (its cost follows its containers), else the line's
    # digit runs (one C-level pass over the bytes, and most lines have no run that long), then the walk.
    huge = _holds_huge_number(value, len(line) // _BYTES_PER_ITEM)
    if huge is None:
        huge = _long_integer_run(line) and bool(_holds_huge_number(value))
    if huge:
        # An integer beyond 64 bits that orjson turned into a float: read the line exactly.
        return json.loads(line)
    return value
