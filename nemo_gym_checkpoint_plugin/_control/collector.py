"""Python's cyclic garbage collector, paused while a restore reads and installs its records, and while
a commit exports and writes them.

A restore of 16,000 records of a few KB decodes some 40 containers per record. The collector
starts a collection every 2,000 new containers, traverses the same new records again and again,
and its full collections walk the whole heap: half the CPU of such a restore in
``benchmarks/control_plane.py`` (1.0 of 2.0 s). Paused from the read until the install ended,
none of that runs inside the restore; before the collector is enabled again, ``promote_to_oldest``
moves the restored state to its oldest generation (otherwise the first allocation after the pause
traverses all of it, 0.46 s there). Decoded JSON records hold no cycles.

Pauses nest (several planes in one process, a restore's read and an install that outlives it);
a collector that was already disabled when the first pause began stays disabled after the last.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused", "promote_to_oldest"]

_lock = threading.Lock()
_depth = 0
_enable_after = False


@contextmanager
def collector_paused() -> Iterator[None]:
    global _depth, _enable_after
    with _lock:
        if _depth == 0:
            _enable_after = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _enable_after:
                gc.enable()


def promote_to_oldest() -> None:
    """Move every object the collector tracks into its oldest generation and reset its counters.

    Called while paused, once a restore installed its records: they are the server's long-lived
    state. Left young, the first allocation after the pause starts a collection that traverses
    every one of them (0.3-0.5 s of CPU for thousands of restored sessions, inside the restore's
    reply) only to promote them. ``gc.freeze()`` then ``gc.unfreeze()`` moves them (and all else)
    to the oldest generation in O(1) and zeroes the counters; full collections still visit them,
    so nothing is kept from the collector. A process that froze objects on purpose
    (``gc.get_freeze_count()`` above 0) is left alone: unfreezing would hand its objects back.
    """
    if gc.get_freeze_count():
        return
    gc.freeze()
    gc.unfreeze()
