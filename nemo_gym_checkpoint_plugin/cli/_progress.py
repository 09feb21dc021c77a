"""Progress of a driving command on stderr (never stdout, never with ``--json``).

One line per participant reply (``[2/4] prepare  model  policy_model  ok (prepared)  0.03s``).
While replies are awaited, a terminal shows a live line (rich's spinner) naming whom the
command waits for, how long it has waited and the time left to the deadline; stderr that is
not a terminal (a log) gets that as a line every ``every`` seconds instead. A failure's
reply line says only its code: the error that follows gives the detail, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from typing import Any, TextIO

from ..coordination import Coordinator, Progress, stages_for
from ..coordination._discovery import Participant
from ._output import console, words

__all__ = ["ProgressDisplay", "showing_progress"]

TTY_REFRESH = 0.25


class ProgressDisplay:
    """The reply lines and the waiting line of one coordinated operation."""

    def __init__(
        self,
        operation: str,
        checkpoint_id: str,
        coordinator: Coordinator,
        deadline_ts: float,
        *,
        stream: TextIO | None = None,
        every: float = 10.0,
    ) -> None:
        self.operation, self.checkpoint_id, self.deadline_ts = operation, checkpoint_id, deadline_ts
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.console = console(self.stream)
        self.every = every
        self.replied: set[str] = set()
        self.live_status: Any = None  # rich's Status while the live line shows
        self.started = time.monotonic()
        # Whom the operation calls, stage by stage: whom it waits for is the first stage not all replied.
        self.stages = [
            staged
            for kinds in stages_for(coordinator.pm, operation)
            if (staged := [p for p in coordinator.participants if p.kind in kinds])
        ]

    def __call__(self, event: Progress) -> None:
        self.replied.add(event.participant.name)
        if event.failure is None:
            outcome = "ok"
            phase = (event.reply or {}).get("phase")
            if phase:
                outcome += f" ({phase})"
        else:
            outcome = f"FAILED {event.failure.code}"
        width = len(str(event.total))
        line = (
            f"  [{event.done:>{width}}/{event.total}] {event.operation:<8} {event.participant.kind:<11} "
            f"{event.participant.name}  {outcome}  {event.elapsed:.2f}s"
        )
        if self.tty:
            if self.live_status is not None:
                self.live_status.update(self.waiting_line() or "")  # now, not at the next refresh
            self.console.print(line)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def waiting_for(self) -> list[Participant]:
        for stage in self.stages:
            pending = [p for p in stage if p.name not in self.replied]
            if pending:
                return pending
        return []

    def waiting_line(self) -> str | None:
        pending = self.waiting_for()
        if not pending:
            return None
        waited = time.monotonic() - self.started
        left = self.deadline_ts - time.time()
        deadline = f"deadline in {left:.0f}s" if left >= 0 else f"deadline passed {-left:.0f}s ago"
        return (
            f"{self.operation} {self.checkpoint_id}: waiting for {words([p.name for p in pending])} "
            f"({waited:.0f}s, {deadline})"
        )

    async def run(self) -> None:
        """Until cancelled or no reply is awaited: the live line (terminal), else a line every ``every`` s."""
        if self.tty:
            # Not redirecting stdout: the summary is printed after this line is gone, never wrapped by it.
            with self.console.status(self.waiting_line() or "", spinner="dots") as self.live_status:
                try:
                    while (line := self.waiting_line()) is not None:
                        self.live_status.update(line)
                        await asyncio.sleep(TTY_REFRESH)  # a display refresh interval, not a wait for a condition
                finally:
                    self.live_status = None
            return
        while True:
            await asyncio.sleep(self.every)  # a log line interval, not a wait for a condition
            line = self.waiting_line()
            if line:
                self.stream.write(f"  ... {line}\n")
                self.stream.flush()


@contextlib.asynccontextmanager
async def showing_progress(display: ProgressDisplay | None, coordinator: Coordinator) -> AsyncIterator[None]:
    """Show ``display`` (None: nothing) while the body runs; stop it when the body ends."""
    if display is None:
        yield
        return
    coordinator.progress = display
    task = asyncio.create_task(display.run())
    try:
        yield
    finally:
        coordinator.progress = None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
