"""``collect`` on SIGTERM: a preemption notice is not wasted.

Cloud and Kubernetes give 30-120 s of warning (SIGTERM, a drain notice) before they kill a machine.
While Gym's collection runs, the first SIGTERM takes one last checkpoint at once, the periodic
checkpoint's own (``CollectionCheckpointer.checkpoint(budget=...)``: prepare, commit the rows in flight,
the collector's state and manifest, resume; one already under way is waited for, inside the budget),
bounded by ``--drain-budget`` seconds, then stops the collection:

- published: exit 0, with the line a run that ended with rows missing prints (``N of M rows are not
  in the output (...); --resume runs them``), said as what it is, not an error, and the command;
- the budget ended first, or a second SIGTERM came meanwhile (stop at once), or the checkpoint
  failed: nothing of it is published (a partial checkpoint has no manifest: no resume takes it), the
  deployment is resumed if it was prepared, and the collector exits 1 naming why and the checkpoint
  a ``--resume`` would continue from.

A SIGTERM before the collection starts (discovery, ownership, a restore) or after it ended keeps
its default meaning: the process ends there, as at a crash, which ``--resume`` handles.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from typing import Any

__all__ = ["DEFAULT_DRAIN_BUDGET", "Drain"]

DEFAULT_DRAIN_BUDGET = 30.0


class Drain:
    """SIGTERM handling for one collection: ``install`` before it runs, ``remove`` and ``wait`` after."""

    def __init__(
        self, checkpointer: Any, budget: float, say: Callable[[str], None], stop: Callable[[], object]
    ) -> None:
        self.checkpointer = checkpointer
        self.budget = budget
        self.say = say
        self.stop = stop  # stops Gym's collection (the drain is over)
        self.signals = 0
        self.started: float | None = None
        self.ended: float | None = None
        self.record: Any = None
        self.interrupted = False
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def draining(self) -> bool:
        return self.signals > 0

    @property
    def published(self) -> bool:
        return self.record is not None and self.record.published

    def install(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_signal_handler(signal.SIGTERM, self._signalled)

    def remove(self) -> None:
        if self._loop is not None:
            self._loop.remove_signal_handler(signal.SIGTERM)
            self._loop = None

    async def wait(self) -> None:
        """The drain under way, if any, to its end."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    def _signalled(self) -> None:
        self.signals += 1
        if self.signals == 1:
            self.started = time.monotonic()
            self.say(
                f"SIGTERM: a last checkpoint now, within the --drain-budget of {self.budget:g}s; "
                "a second SIGTERM stops at once without it"
            )
            self.checkpointer.stop()  # no periodic checkpoint after this one
            self._task = asyncio.create_task(self._drain())
        elif self._task is not None and not self._task.done():
            self.say("second SIGTERM: stopping at once, without the last checkpoint")
            self._task.cancel()

    async def _drain(self) -> None:
        try:
            self.record = await self.checkpointer.checkpoint(budget=self.budget)
        except asyncio.CancelledError:
            self.interrupted = True
            self.record = self.checkpointer.checkpoints[-1] if self.checkpointer.checkpoints else None
        finally:
            self.ended = time.monotonic()
            self.stop()

    def to_json(self) -> dict[str, Any] | None:
        if not self.draining:
            return None
        record = self.record
        return {
            "signal": "SIGTERM",
            "signals": self.signals,
            "budget_s": self.budget,
            "checkpoint": None if record is None else record.checkpoint_id,
            "published": self.published,
            "problem": None if record is None or self.published else record.problem,
            "paused_s": None if record is None else round(record.paused_s, 3),
            # Seconds from the signal to the end of the last checkpoint (published or not).
            "after_s": None if self.ended is None or self.started is None else round(self.ended - self.started, 3),
        }

    def report(self, missing_line: str | None, last_published: str | None) -> tuple[list[str], list[str]]:
        """(lines to say, errors) once the collection stopped on a SIGTERM."""
        elapsed = (self.ended or time.monotonic()) - (self.started or time.monotonic())
        if self.published:
            lines = [
                f"stopped on SIGTERM: checkpoint {self.record.checkpoint_id} published "
                f"{elapsed:.2f}s after the signal (--drain-budget {self.budget:g}s)"
            ]
            if missing_line is not None:
                lines.append(missing_line)
            lines.append(
                "continue with the same command and --resume, on fresh servers (these ran on past the checkpoint)"
            )
            return lines, []
        if self.interrupted:
            why = "a second SIGTERM stopped it"
        elif self.record is None:
            why = "no checkpoint was taken"
        else:
            why = self.record.problem or "it was not published"
        since = f"from {last_published}" if last_published else "from the output file alone (no published checkpoint)"
        return [], [
            f"stopped on SIGTERM without a last checkpoint ({why}); nothing of it was published, the "
            f"deployment was resumed (a resume that failed is logged above); --resume continues {since}"
        ]
