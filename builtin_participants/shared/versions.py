"""Versions of the built-in participants' records: what lets a later checkpoint refer to an unchanged one.

A participant exports ``api.Versioned(episode_id, version, record)`` (docs/plugins.md, "Versioned
records"); the writer refers to the participant's previous record of the episode when the versions
compare equal. A version that stays equal while the record changed restores a stale record, so the
versions here err towards changing:

- ``stamp()``: a new value of one process-wide counter. A participant stamps an episode on every
  change of what its record holds; two states of an episode never share a stamp, even across the
  objects that held it (an attempt ended and begun again, a restored episode started).
- ``Same(obj)``: compares equal only to a ``Same`` of the very same object, and holds it (so its
  ``id`` is never reused while a version names it). For state a participant does not own (Gym's
  session objects), whose changes replace an attribute's object rather than mutate it, a version
  made of ``Same`` parts changes whenever one of those objects is replaced.
"""

from __future__ import annotations

import itertools
from typing import Any

__all__ = ["Same", "stamp"]

_STAMPS = itertools.count(1)


def stamp() -> int:
    """A value no earlier call returned in this process (``next`` of a counter: atomic under the GIL)."""
    return next(_STAMPS)


class Same:
    """Equal to a ``Same`` of the identical object only (``is``), whatever the object's own ``==``."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return type(other) is Same and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"Same({type(self.obj).__name__} at {id(self.obj):#x})"
