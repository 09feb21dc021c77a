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


def _needs_fallback(value: Any) -> bool:
    """True when orjson would have changed the value: a NaN or infinity somewhere.

    Walks containers only; a list of plain numbers (token ids, logprobs) is checked in one
    C-level pass, so the cost follows the record's structure, not its size in bytes.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is float:
            if not math.isfinite(item):
                return True
        elif kind is dict:
            stack.extend(item.values())
        elif kind is list or kind is tuple:
            if not _all_finite_numbers(item):
                stack.extend(item)
    return False


def _all_finite_numbers(items: list[Any] | tuple[Any, ...]) -> bool:
    """True when every item is a number and none is NaN or infinite; False means "look closer".

    ``math.fsum`` propagates NaN and infinities, so a finite sum proves every term finite.
    It raises for non-numbers (TypeError), for +inf with -inf (ValueError), and for integers
    too large for a float or sums that overflow (OverflowError): those lists are walked item
    by item.
    """
    try:
        return math.isfinite(math.fsum(items))
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
    if _needs_fallback(value):
        return _stdlib_line(value), True
    return line, False


def encode_line(value: Any) -> bytes:
    """One JSON line (newline included) that ``decode_line`` turns back into an equal value."""
    return encode_record(value)[0]


# orjson reads an integer beyond 64 bits as a float, silently. Such a float is at least 2**63 in
# magnitude, so a decoded record holding no float that large cannot have lost one: the screen
# walks the decoded containers (a list of numbers in one C-level ``math.hypot`` pass, which is
# at least the largest magnitude in it) instead of every byte of the line. Only a record that
# holds such a number is looked at closer: its line is read exactly when it has a run of 19
# digits (which an integer beyond 64 bits has and no float either library writes has; digits
# map to "0", everything else to " ", and a C-level substring search finds the run).
_HUGE = float(2**63)
_DIGITS_ONLY = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_RUN = b"0" * 19


def _holds_huge_number(value: Any) -> bool:
    """True when a number of magnitude 2**63 or more is somewhere in ``value`` (orjson's output)."""
    stack = [value]
    while stack:
        item = stack.pop()
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
    if _holds_huge_number(value) and _LONG_RUN in line.translate(_DIGITS_ONLY):
        # An integer beyond 64 bits that orjson turned into a float: read the line exactly.
        return json.loads(line)
    return value
