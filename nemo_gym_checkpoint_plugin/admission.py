"""Shared state between the control plane (which changes it) and the admission gate (which reads it).

``Admission`` says whether new data requests may enter; ``RetiredMarks`` says which
attempts of a rollout were retired. Both live on one participant's control plane;
the gate holds a reference and reads them on every request, so reading is cheap
(an attribute and a dict lookup) and nothing here is per-step work.
"""

from __future__ import annotations

import asyncio

__all__ = ["Admission", "RetiredMarks"]


class Admission:
    """Open/closed admission of new data requests. Closed while a checkpoint is being taken.

    Requests that arrive while closed park in ``wait_open()`` until the next ``open()``
    (never refused: Gym's client would just resend them). Must be used from the event
    loop thread of the server.
    """

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()

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


class RetiredMarks:
    """Per rollout, the highest retired attempt. A mark only ever rises; ``forget`` removes it."""

    def __init__(self) -> None:
        self._marks: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._marks)

    def mark(self, rollout_id: str, up_to_attempt: int) -> None:
        """Retire every attempt of ``rollout_id`` up to and including ``up_to_attempt``."""
        if up_to_attempt > self._marks.get(rollout_id, -1):
            self._marks[rollout_id] = up_to_attempt

    def is_retired(self, rollout_id: str, attempt: int) -> bool:
        mark = self._marks.get(rollout_id)
        return mark is not None and attempt <= mark

    def retired_up_to(self, rollout_id: str) -> int | None:
        return self._marks.get(rollout_id)

    def forget(self, rollout_id: str) -> bool:
        """Remove the mark; returns whether there was one."""
        return self._marks.pop(rollout_id, None) is not None
