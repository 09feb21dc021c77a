"""``collector_paused``: no garbage collection while a hook builds thousands of objects at once.

A restore installs one session per episode: at 16,000 episodes the agent's install allocates
enough objects for CPython to run several full collections of the server's whole heap in the
middle of it (each one traverses every object the process holds), which tripled the install's
cost in ``benchmarks/participants.py --gc``. Pausing the collector for the bulk build defers that
to the collector's normal pace once the hook is done: nothing is freed later than it would be by
reference counting (only cycles wait), and the collector's previous state always comes back.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """Disable automatic garbage collection inside the block; re-enable it after only if it was on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
