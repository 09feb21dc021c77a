"""Python's cyclic garbage collector, paused while a restore reads and installs its records, and while
a commit exports and writes them.

A restore of 16,000 records of a few KB decodes some 40 containers per record. The garbage collector
starts a collection every 2,000 new containers, traverses the same new records again and again,
and its full collections walk the whole heap: half the CPU of such a restore in
``benchmarks/control_plane.py`` (1.0 of 2.0 s). Paused from the read until the install ended,
none of that runs inside the restore; before garbage collection is enabled again, ``promote_to_oldest``
moves the restored state to its oldest generation (otherwise the first allocation after the pause
traverses all of it, 0.46 s there). Decoded JSON records hold no cycles.

Pauses nest (several planes in one process, a restore's read and an install that outlives it);
garbage collection that was already disabled when the first pause began stays disabled after the last.

The heap is also **frozen for the whole of a checkpoint or restore** (``hold_heap``: from its
prepare or restore until its resume or return to idle) and for the controller's fan-out of each
operation (``heap_frozen``). A server holding thousands of rollouts has millions of objects
tracked; the garbage collector walks all of them in a full collection (3 to 4 s on this project's 2-core
machine at 2,000 rollouts per server), and one falls due every few seconds while rollouts pile
up. One landing inside a commit made it 1.7 s instead of 0.7 s (``benchmarks/scale.py``, 4,000
rollouts: one server's commit used 1.35 s of CPU where its twin used 0.14 s). ``gc.freeze()``
moves every tracked object to the permanent generation in O(1): while held, collections (young
and full) only see what was allocated since, so the checkpoint's own garbage is still collected;
``gc.unfreeze()`` at the end moves everything to the oldest generation, again in O(1), and later
full collections visit it as before. Holds nest; a process that froze objects itself
(``gc.get_freeze_count()`` above 0 when the first hold began) is left alone, since unfreezing
would hand its objects back.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["HeapHold", "gc_paused", "heap_frozen", "hold_heap", "promote_to_oldest"]

_lock = threading.Lock()
_depth = 0
_enable_after = False
_holds = 0
_we_froze = False


@contextmanager
def gc_paused() -> Iterator[None]:
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
    with _lock:
        if _we_froze:
            gc.freeze()  # joins the held heap; the hold's release moves all of it to the oldest generation
            return
        if gc.get_freeze_count():
            return
        gc.freeze()
        gc.unfreeze()


class HeapHold:
    """One hold of the frozen heap (``hold_heap``); ``release`` is idempotent."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        global _holds, _we_froze
        with _lock:
            if _holds == 0:
                _we_froze = gc.get_freeze_count() == 0
                if _we_froze:
                    gc.freeze()
            _holds += 1
        self._held = True

    def release(self) -> None:
        global _holds, _we_froze
        with _lock:
            if not self._held:
                return
            self._held = False
            _holds -= 1
            if _holds == 0 and _we_froze:
                _we_froze = False
                gc.unfreeze()


def hold_heap() -> HeapHold:
    """Freeze every object the collector tracks until the returned hold (and every other) is released."""
    return HeapHold()


@contextmanager
def heap_frozen() -> Iterator[None]:
    """``hold_heap`` for the duration of the block."""
    hold = HeapHold()
    try:
        yield
    finally:
        hold.release()
