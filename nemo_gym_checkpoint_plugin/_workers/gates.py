"""The admission gates of a server's workers, as one gate for its metrics (docs/telemetry.md).

A server with several workers has one admission gate per worker and none in the main process, whose
plane serves ``GET /ng-control/v1/checkpoint/metrics``. Each worker keeps what its gate counts
(``_gate.GateCounters``: requests parked now, parks, ``stale_attempt`` refusals) and how long each park
waited (``_telemetry.metrics.ParkTimes``, fed on the parked path only): nothing is sent per request.
Before each scrape the coordinator asks every worker for them (``messages.GATE_FIGURES``, bounded by its
scrape timeout) and ``WorkerGates`` sums them:

- requests parked now: over the workers connected at the last ask;
- parks, refusals and the parked-duration histogram: over every worker that ever answered, so the
  server's counters never go down when a worker dies (what it counted since the scrape before its
  death is lost); a worker that does not answer in time counts with what it answered last.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nemo_gym_checkpoint_plugin._gate import GateCounters
from nemo_gym_checkpoint_plugin._telemetry.metrics import DURATION_BUCKETS, ParkTimes

__all__ = ["WorkerGates", "figures_from_wire", "figures_to_wire"]


@dataclass(frozen=True)
class _Figures:
    parked: int
    parks: int
    refused: int
    park_counts: tuple[int, ...]
    park_sum: float


def figures_to_wire(counters: GateCounters, times: ParkTimes) -> dict[str, Any]:
    """One worker's gate figures, as it answers ``GATE_FIGURES``."""
    return {
        "parked": counters.parked,
        "parks": counters.parks,
        "refused": counters.refused,
        "park_counts": list(times.counts),
        "park_sum": times.sum,
    }


def figures_from_wire(body: Any) -> _Figures:
    """A worker's answer, checked (``ValueError`` for anything else)."""
    if not isinstance(body, Mapping):
        raise ValueError(f"gate figures must be an object, not {type(body).__name__}")
    counts = body.get("park_counts")
    if not (isinstance(counts, list) and len(counts) == len(DURATION_BUCKETS) + 1):
        raise ValueError("gate figures need one park count per histogram bucket")
    parked, parks, refused = (_count(body.get(name)) for name in ("parked", "parks", "refused"))
    park_sum = body.get("park_sum")
    if not isinstance(park_sum, int | float) or isinstance(park_sum, bool):
        raise ValueError("gate figures need the seconds parked in all")
    return _Figures(parked, parks, refused, tuple(_count(count) for count in counts), float(park_sum))


def _count(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"gate figures are counts (integers >= 0), not {value!r:.40}")
    return value


class WorkerGates:
    """The workers' gates summed (``_telemetry.metrics.WorkersGateFigures``). Use from the coordinator's loop."""

    def __init__(self) -> None:
        self._figures: dict[str, _Figures] = {}
        self._connected: frozenset[str] = frozenset()

    def update(self, replies: Mapping[str, Any], connected: Iterable[str]) -> list[str]:
        """Take the workers' answers (by worker name) and who is connected now; the names whose answer was refused."""
        refused = []
        for name, body in replies.items():
            try:
                self._figures[name] = figures_from_wire(body)
            except ValueError:
                refused.append(name)
        self._connected = frozenset(connected)
        return refused

    @property
    def parked(self) -> int:
        return sum(f.parked for name, f in self._figures.items() if name in self._connected)

    @property
    def parks(self) -> int:
        return sum(f.parks for f in self._figures.values())

    @property
    def refused(self) -> int:
        return sum(f.refused for f in self._figures.values())

    def park_times(self) -> tuple[list[int], float]:
        counts = [0] * (len(DURATION_BUCKETS) + 1)
        seconds = 0.0
        for figures in self._figures.values():
            for index, count in enumerate(figures.park_counts):
                counts[index] += count
            seconds += figures.park_sum
        return counts, seconds
