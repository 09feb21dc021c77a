"""Shared state between the control plane (which changes it) and the admission gate (which reads it).

``Admission`` says whether new data requests may enter; ``RetiredMarks`` says which
attempts of a rollout were retired. Both live on one participant's control plane;
the gate holds a reference and reads them on every request, so reading is cheap
(an attribute and a dict lookup) and nothing here is per-step work.

``RetiredMarks`` also keeps the registry of data requests parked at closed admission
under an attributed attempt (``parking``): a mark that rises over a parked attempt
flags it and wakes it at once, so the gate refuses it with ``stale_attempt`` without
waiting for resume, and the flag stays even if ``forget`` removes the mark before
admission reopens. ``retire`` waits (``parked_left``) until every flagged request has
been answered. Only parked requests pay for this registry, never the gate's fast path.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

__all__ = ["Admission", "ParkedRequest", "RetiredMarks"]


class Admission:
    """Open/closed admission of new data requests. Closed while a checkpoint is being taken.

    Requests that arrive while closed park in ``wait_open()`` until the next ``open()``
    (never refused: Gym's client would just resend them). Must be used from the event
    loop thread of the server.
    """

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        # Set by the gate at the first data request: a server that served episodes refuses a restore
        # (docs/protocol.md "Phases": what it holds may belong to live episodes).
        self.served = False
        # Why a restore is refused even if nothing was served here (a server with several workers one of
        # which left: what it held may still be referred to); None: no such reason.
        self.restore_refusal: str | None = None

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def wait_open(self) -> None:
        # A request that wakes to find admission closed again (a new checkpoint) parks again.
        while not self._open.is_set():
            await self._open.wait()

    async def wait_open_or(self, other: asyncio.Event) -> None:
        """Return once admission is open or ``other`` is set (whichever first; it may be closed again)."""
        if self._open.is_set() or other.is_set():
            return
        waiters = [asyncio.ensure_future(self._open.wait()), asyncio.ensure_future(other.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()


class ParkedRequest:
    """One data request parked under ``(rollout_id, attempt)``; ``retired`` once a mark rose over it."""

    __slots__ = ("rollout_id", "attempt", "retired", "woken")

    def __init__(self, rollout_id: str, attempt: int) -> None:
        self.rollout_id = rollout_id
        self.attempt = attempt
        self.retired = False
        self.woken = asyncio.Event()


class RetiredMarks:
    """Per rollout, the highest retired attempt. A mark only ever rises; ``forget`` removes it."""

    def __init__(self) -> None:
        self._marks: dict[str, int] = {}
        # Parked data requests by rollout id; only attributed requests parked at closed admission.
        self._parked: dict[str, list[ParkedRequest]] = {}
        self._left = asyncio.Event()

    def __len__(self) -> int:
        return len(self._marks)

    def mark(self, rollout_id: str, up_to_attempt: int) -> None:
        """Retire every attempt of ``rollout_id`` up to and including ``up_to_attempt``."""
        if up_to_attempt > self._marks.get(rollout_id, -1):
            self._marks[rollout_id] = up_to_attempt
            for parked in self._parked.get(rollout_id, ()):
                if parked.attempt <= up_to_attempt and not parked.retired:
                    # Flagged for good: a forget before admission reopens does not unflag it.
                    parked.retired = True
                    parked.woken.set()

    def mark_many(self, pairs: Iterable[tuple[str, int]]) -> None:
        """``mark`` of each ``(rollout_id, attempt)``; without parked requests, one pass over the marks' dict."""
        if self._parked:
            for rollout_id, attempt in pairs:
                self.mark(rollout_id, attempt)
            return
        # A restore's scope names 16,000 ids at every server: a method call per id costs more than the mark.
        marks = self._marks
        get = marks.get
        for rollout_id, attempt in pairs:
            if attempt > get(rollout_id, -1):
                marks[rollout_id] = attempt

    def is_retired(self, rollout_id: str, attempt: int) -> bool:
        mark = self._marks.get(rollout_id)
        return mark is not None and attempt <= mark

    def retired_up_to(self, rollout_id: str) -> int | None:
        return self._marks.get(rollout_id)

    def named(self, limit: int) -> dict[str, int]:
        """At most ``limit`` marks (rollout id -> highest retired attempt), the first rollout ids in order.

        A controller names leftover marks from ``status`` (``retired_marks``); bounded so a
        participant holding thousands of marks keeps a small reply (``retired_rollouts`` counts all).
        """
        return {rollout_id: self._marks[rollout_id] for rollout_id in heapq.nsmallest(limit, self._marks)}

    def snapshot(self) -> dict[str, int]:
        """Every mark (rollout id -> highest retired attempt): what a worker registering late starts with."""
        return dict(self._marks)

    def forget(self, rollout_id: str) -> bool:
        """Remove the mark; returns whether there was one."""
        return self._marks.pop(rollout_id, None) is not None

    # -- parked requests (the gate's slow path) ------------------------------------------------

    @contextmanager
    def parking(self, rollout_id: str, attempt: int) -> Iterator[ParkedRequest]:
        """Register a request parked under this attempt for as long as the block runs.

        Leave the block only once the request was answered: ``parked_left`` counts it until then.
        """
        parked = ParkedRequest(rollout_id, attempt)
        parked.retired = self.is_retired(rollout_id, attempt)
        self._parked.setdefault(rollout_id, []).append(parked)
        try:
            yield parked
        finally:
            siblings = self._parked[rollout_id]
            siblings.remove(parked)
            if not siblings:
                del self._parked[rollout_id]
            if parked.retired:
                self._left.set()
                self._left = asyncio.Event()

    def retired_parked(self, rollout_ids: Iterable[str]) -> int:
        """How many requests of these rollouts are parked with a retired attempt (not yet answered)."""
        return sum(p.retired for r in set(rollout_ids) for p in self._parked.get(r, ()))

    async def parked_left(self, rollout_ids: Iterable[str]) -> None:
        """Return once no request of these rollouts parked under a retired attempt is left unanswered."""
        rollouts = set(rollout_ids)
        while self.retired_parked(rollouts):
            await self._left.wait()
