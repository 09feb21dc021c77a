"""Python's cyclic garbage collector, paused while a restore reads and installs its records, and while
a commit exports and writes them.

A restore of 16,000 records of a few KB decodes some 40 containers per record. The collector
starts a collection every 2,000 new containers, traverses the same new records again and again,
and its full collections walk the whole heap: half the CPU of such a restore in
``benchmarks/control_plane.py`` (1.0 of 2.0 s). Paused from the read until the install ended,
none of that runs inside the restore; once the collector is enabled again, it collects when its
thresholds say so (one full collection there, 0.46 s). Decoded JSON records hold no cycles.

Pauses nest (several planes in one process, a restore's read and an install that outlives it);
a collector that was already disabled when the first pause began stays disabled after the last.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]

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
