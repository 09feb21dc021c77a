"""One participant server's checkpoint metrics, in a registry of its own (docs/telemetry.md "Metrics").

``ServerMetrics`` is built by the control plane (so only where checkpointing is on) and holds a
``prometheus_client.CollectorRegistry`` that is never the process-wide default: a server embedding
several apps (tests), or Gym's own metrics on the default registry, never see each other's series.
The names are OpenTelemetry-style ``gym.checkpoint.*`` with UCUM units (``METRICS`` lists each with
its Prometheus exposition name, which adds ``_seconds``, ``_bytes``, ``_total``). No label ever
carries a checkpoint id or an episode key: labels are bounded sets (operation, stage, error code).

Values the plane already keeps (requests parked at the gate and refused by it, the lease's
self-resumes, the phase) are read at scrape time by a collector, so nothing on the data path changes
for them. The held responses of a model server are refreshed from the participants' ``ready`` counts
before each scrape (``refresh``), as ``status`` reads them.

A server with several workers has one gate per worker, none in the main process whose plane serves
the metrics: ``watch_workers`` reads the workers' figures instead (``_workers/gates.py``: each worker
keeps its gate's counters and its parks' waits as ``ParkTimes``, and the coordinator asks every worker
for them before each scrape), so the parked requests, the refusals and the parked-duration histogram
are the server's, summed over its workers.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .gym_export import GymMeter, gym_meter
from .names import METRICS, MetricName

if TYPE_CHECKING:
    from nemo_gym_checkpoint_plugin._gate import GateCounters

__all__ = [
    "CONTENT_TYPE",
    "DURATION_BUCKETS",
    "METRICS",
    "GateFigures",
    "MetricName",
    "ParkTimes",
    "ServerMetrics",
    "WorkersGateFigures",
    "error_code",
]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds: a prepare of an idle server takes milliseconds, a commit of a large one minutes.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# The count a model server's ``ready`` hook reports for responses held at closed admission.
HELD_RESPONSES_COUNT = "model_responses_held"


_BY_OTEL = {metric.otel: metric for metric in METRICS}


class ParkTimes:
    """How long each parked request waited, as the plain figures of the parked-duration histogram.

    For a process without a registry (a worker of a server with several workers): its gate's
    ``observe_park`` feeds it, on the parked path only. ``counts[i]`` are the parks that waited at
    most ``DURATION_BUCKETS[i]`` (and more than the bound before), the last those longer than every
    bound; ``sum`` the seconds waited in all.
    """

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(DURATION_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(DURATION_BUCKETS, seconds)] += 1
        self.sum += seconds


class GateFigures(Protocol):
    """What the metrics read of an admission gate at scrape time (``_gate.GateCounters`` is one)."""

    @property
    def parked(self) -> int: ...

    @property
    def refused(self) -> int: ...


class WorkersGateFigures(GateFigures, Protocol):
    """The gates of a server's workers as one (``_workers/gates.py``): their parks' waits too."""

    def park_times(self) -> tuple[list[int], float]:
        """Per-bucket counts (``ParkTimes.counts``) and the seconds, summed over the workers."""
        ...


def _help(otel: str) -> str:
    metric = _BY_OTEL[otel]
    return f"{metric.meaning} ({metric.otel}, unit {metric.unit})"


def error_code(exc: BaseException) -> str:
    """The bounded code a failed call is counted under: the protocol's, else ``internal``."""
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code:
        return code
    from nemo_gym_checkpoint_plugin._types import DeadlineTooFar

    if isinstance(exc, DeadlineTooFar):
        return "deadline_too_far"
    return "internal"


class _Live(Collector):
    """The values read at scrape time from what the plane and the gate already keep."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterator[Metric]:
        # Read only at scrape time: registering must not read a plane still being built.
        return iter(())

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        in_progress = GaugeMetricFamily(
            "gym_checkpoint_in_progress", _help("gym.checkpoint.in_progress"), labels=["operation"]
        )
        active = m.active_operation()
        for operation in ("checkpoint", "restore"):
            in_progress.add_metric([operation], 1.0 if active == operation else 0.0)
        yield in_progress
        yield GaugeMetricFamily(
            "gym_checkpoint_admission_closed",
            _help("gym.checkpoint.admission.closed"),
            value=0.0 if m.admission_open() else 1.0,
        )
        gate = m.gate
        yield GaugeMetricFamily(
            "gym_checkpoint_parked_requests",
            _help("gym.checkpoint.parked.requests"),
            value=float(gate.parked if gate is not None else 0),
        )
        yield CounterMetricFamily(
            "gym_checkpoint_refused_requests",
            _help("gym.checkpoint.refused.requests"),
            value=float(gate.refused if gate is not None else 0),
        )
        workers = m.workers_gate
        if workers is not None:
            counts, seconds = workers.park_times()
            cumulative, buckets = 0, []
            for bound, count in zip([*DURATION_BUCKETS, float("inf")], counts, strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), float(cumulative)))
            yield HistogramMetricFamily(
                "gym_checkpoint_parked_duration",
                _help("gym.checkpoint.parked.duration"),
                buckets=buckets,
                sum_value=seconds,
                unit="seconds",
            )
        yield GaugeMetricFamily(
            "gym_checkpoint_held_responses", _help("gym.checkpoint.held.responses"), value=float(m.held_responses)
        )
        last = GaugeMetricFamily(
            "gym_checkpoint_last_success_time_seconds", _help("gym.checkpoint.last_success.time"), unit="seconds"
        )
        if m.last_success is not None:
            last.add_metric([], m.last_success)
        yield last
        yield CounterMetricFamily(
            "gym_checkpoint_lease_expiries", _help("gym.checkpoint.lease.expiries"), value=float(m.lease_expiries())
        )


class ServerMetrics:
    """The metrics of one participant server; ``registry`` is its own (never prometheus_client's default).

    ``active_operation``, ``admission_open`` and ``lease_expiries`` are read at scrape time (the plane
    hands them in); ``watch_gate`` connects the admission gate's counters once the gate is installed.
    """

    def __init__(
        self,
        kind: str,
        instance: str,
        *,
        active_operation: Callable[[], str | None] = lambda: None,
        admission_open: Callable[[], bool] = lambda: True,
        lease_expiries: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.time,
        resolve_gym_meter: Callable[[], Any] | None = None,
    ) -> None:
        self.kind = kind
        self.instance = instance
        self.active_operation = active_operation
        self.admission_open = admission_open
        self.lease_expiries = lease_expiries
        self._clock = clock
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.duration = Histogram(
            "gym_checkpoint_duration",
            _help("gym.checkpoint.duration"),
            ["phase"],
            unit="seconds",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.stage_duration = Histogram(
            "gym_checkpoint_stage_duration",
            _help("gym.checkpoint.stage.duration"),
            ["stage"],
            unit="seconds",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.completed = Counter("gym_checkpoint_completed", _help("gym.checkpoint.completed"), registry=r)
        self.restored = Counter("gym_checkpoint_restored", _help("gym.checkpoint.restored"), registry=r)
        self.failed = Counter("gym_checkpoint_failed", _help("gym.checkpoint.failed"), ["phase", "code"], registry=r)
        self.size = Gauge("gym_checkpoint_size", _help("gym.checkpoint.size"), unit="bytes", registry=r)
        self.records = Gauge("gym_checkpoint_records", _help("gym.checkpoint.records"), registry=r)
        self.episodes = Gauge("gym_checkpoint_episodes", _help("gym.checkpoint.episodes"), registry=r)
        self.admission_closed = Histogram(
            "gym_checkpoint_admission_closed_duration",
            _help("gym.checkpoint.admission.closed.duration"),
            unit="seconds",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.parked_duration = Histogram(
            "gym_checkpoint_parked_duration",
            _help("gym.checkpoint.parked.duration"),
            unit="seconds",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.restarts = Counter("gym_checkpoint_restarts", _help("gym.checkpoint.restarts"), registry=r)
        self.gate: GateFigures | None = None
        # A server with several workers: their gates' figures (``watch_workers``), asked for by ``refresh_gate``.
        self.workers_gate: WorkersGateFigures | None = None
        self.refresh_gate: Callable[[], Awaitable[None]] | None = None
        self.held_responses = 0
        self._closed_at: float | None = None
        # Unix time of the last published checkpoint; None until one (a 0 would say "in 1970").
        self.last_success: float | None = None
        self.last_size: float | None = None
        self.last_records: float | None = None
        self.last_episodes: float | None = None
        r.register(_Live(self))
        # The same figures on Gym's own meter where its metrics export is on (gym_export.py).
        self.gym = GymMeter(self, resolve=gym_meter if resolve_gym_meter is None else resolve_gym_meter)
        self.gym.bind()

    # -- what the plane reports ------------------------------------------------------------------

    def watch_gate(self, counters: GateCounters) -> None:
        """Read the admission gate's parked requests and refusals at scrape time and time each park."""
        self.gate = counters
        counters.observe_park = self._parked

    def watch_workers(self, gates: WorkersGateFigures, refresh: Callable[[], Awaitable[None]]) -> None:
        """A server with several workers: read their gates (``gates``, refreshed by ``refresh`` before each scrape).

        The parked-duration histogram is then the workers' (their gates' park times): no park is timed here.
        """
        self.gate = gates
        self.workers_gate = gates
        self.refresh_gate = refresh
        self.registry.unregister(self.parked_duration)

    def _parked(self, seconds: float) -> None:
        self.parked_duration.observe(seconds)
        self.gym.record("gym.checkpoint.parked.duration", seconds)

    def call_ended(self, phase: str, seconds: float, error: BaseException | None = None) -> None:
        self.duration.labels(phase).observe(seconds)
        self.gym.record("gym.checkpoint.duration", seconds, {"phase": phase})
        if error is not None:
            code = error_code(error)
            self.failed.labels(phase, code).inc()
            self.gym.add("gym.checkpoint.failed", 1, {"phase": phase, "code": code})

    def stage_ended(self, stage: str, seconds: float) -> None:
        self.stage_duration.labels(stage).observe(seconds)
        self.gym.record("gym.checkpoint.stage.duration", seconds, {"stage": stage})

    def admission_closing(self) -> None:
        if self._closed_at is None:
            self._closed_at = time.monotonic()

    def admission_opened(self) -> float | None:
        """Admission reopened: observe and return how long it was closed (None: it was not)."""
        closed_at, self._closed_at = self._closed_at, None
        if closed_at is None:
            return None
        paused = time.monotonic() - closed_at
        self.admission_closed.observe(paused)
        self.gym.record("gym.checkpoint.admission.closed.duration", paused)
        return paused

    def checkpoint_published(self, manifest: dict[str, Any], episodes: int, size: int | None) -> None:
        self.completed.inc()
        self.gym.add("gym.checkpoint.completed")
        self.last_success = self._clock()
        count = manifest.get("record_count")
        if isinstance(count, int):
            self.records.set(count)
            self.last_records = float(count)
        self.episodes.set(episodes)
        self.last_episodes = float(episodes)
        if size is not None:
            self.size.set(size)
            self.last_size = float(size)

    def restore_installed(self) -> None:
        self.restored.inc()
        self.gym.add("gym.checkpoint.restored")

    def restarts_reported(self, count: int) -> None:
        if count:
            self.restarts.inc(count)
            self.gym.add("gym.checkpoint.restarts", count)

    def set_held_responses(self, counts: dict[str, Any]) -> None:
        held = counts.get(HELD_RESPONSES_COUNT, 0)
        self.held_responses = held if isinstance(held, int) and not isinstance(held, bool) else 0

    # -- exposition ------------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
