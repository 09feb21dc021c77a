"""The checkpoint metrics on Gym's own OpenTelemetry meter, where Gym's metrics export is on.

Gym 0.7.0 exports metrics through nemo-lens: ``nemo_gym.telemetry.setup.get_telemetry()`` is the
process's handle and ``is_metrics_exporter_active()`` says whether it exports metrics (Gym's
``telemetry:`` block with ``metrics_enabled``, or the providers of a NeMo RL process Gym runs in).
Where it does, every ``gym.checkpoint.*`` metric of ``names.METRICS`` is also an instrument on the
handle's meter, under its OpenTelemetry name and UCUM unit, with the same bounded attributes (never
a checkpoint id or an episode key): histograms and counters recorded as the plane reports, gauges
observed at each export from what the server keeps. The Prometheus route serves the same figures
either way.

The meter is looked up at each report (a dictionary read and a flag in Gym), so a server whose
telemetry came up after its control plane still exports, and nothing is created where Gym's export
is off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .metrics import ServerMetrics

__all__ = ["GymMeter", "gym_meter"]

logger = logging.getLogger(__name__)

_HISTOGRAMS = (
    "gym.checkpoint.duration",
    "gym.checkpoint.stage.duration",
    "gym.checkpoint.admission.closed.duration",
    "gym.checkpoint.parked.duration",
)
_COUNTERS = ("gym.checkpoint.completed", "gym.checkpoint.restored", "gym.checkpoint.failed", "gym.checkpoint.restarts")


def gym_meter() -> Any | None:
    """Gym's meter when its metrics export is active in this process, else None (never raises)."""
    try:
        from nemo_gym.telemetry.setup import get_telemetry, is_metrics_exporter_active
    except Exception:  # a process without nemo_gym (a bare embedding): there is no Gym export
        return None
    if not is_metrics_exporter_active():
        return None
    handle = get_telemetry()
    if handle is None or not getattr(handle, "is_exporting", False):
        return None
    return getattr(handle, "meter", None)


class GymMeter:
    """One server's ``gym.checkpoint.*`` instruments on Gym's meter (created once per meter)."""

    def __init__(self, metrics: ServerMetrics, resolve: Callable[[], Any | None] = gym_meter) -> None:
        self._metrics = metrics
        self._resolve = resolve
        self._meter_id: int | None = None
        self._instruments: dict[str, Any] = {}

    def _bound(self) -> dict[str, Any] | None:
        try:
            meter = self._resolve()
        except Exception:
            logger.debug("Gym's meter unavailable", exc_info=True)
            return None
        if meter is None:
            return None
        if id(meter) != self._meter_id:
            self._instruments = self._create(meter)
            self._meter_id = id(meter)
        return self._instruments

    def _create(self, meter: Any) -> dict[str, Any]:
        from .names import METRICS

        by_name = {metric.otel: metric for metric in METRICS}
        made: dict[str, Any] = {}
        for name in _HISTOGRAMS:
            made[name] = meter.create_histogram(name, unit=by_name[name].unit, description=by_name[name].meaning)
        for name in _COUNTERS:
            made[name] = meter.create_counter(name, unit=by_name[name].unit, description=by_name[name].meaning)
        for name, read in self._observed().items():
            metric = by_name[name]
            factory = meter.create_observable_counter if metric.type == "counter" else meter.create_observable_gauge
            made[name] = factory(name, callbacks=[_callback(read)], unit=metric.unit, description=metric.meaning)
        return made

    def _observed(self) -> dict[str, Callable[[], Iterable[tuple[float, dict[str, str]]]]]:
        m = self._metrics

        def in_progress() -> Iterable[tuple[float, dict[str, str]]]:
            active = m.active_operation()
            return [(1.0 if active == op else 0.0, {"operation": op}) for op in ("checkpoint", "restore")]

        def last(value: Callable[[], float | None]) -> Callable[[], Iterable[tuple[float, dict[str, str]]]]:
            def read() -> Iterable[tuple[float, dict[str, str]]]:
                found = value()
                return [] if found is None else [(float(found), {})]

            return read

        return {
            "gym.checkpoint.in_progress": in_progress,
            "gym.checkpoint.admission.closed": last(lambda: 0.0 if m.admission_open() else 1.0),
            "gym.checkpoint.parked.requests": last(lambda: float(m.gate.parked) if m.gate is not None else 0.0),
            "gym.checkpoint.refused.requests": last(lambda: float(m.gate.refused) if m.gate is not None else 0.0),
            "gym.checkpoint.held.responses": last(lambda: float(m.held_responses)),
            "gym.checkpoint.last_success.time": last(lambda: m.last_success),
            "gym.checkpoint.size": last(lambda: m.last_size),
            "gym.checkpoint.records": last(lambda: m.last_records),
            "gym.checkpoint.episodes": last(lambda: m.last_episodes),
            "gym.checkpoint.lease.expiries": last(lambda: float(m.lease_expiries())),
        }

    def record(self, name: str, value: float, attributes: dict[str, str] | None = None) -> None:
        """Record ``value`` into the histogram ``name`` (a no-op while Gym's export is off)."""
        instruments = self._bound()
        if instruments is not None:
            try:
                instruments[name].record(value, attributes=attributes or {})
            except Exception:  # telemetry never fails a control call
                logger.debug("could not record %s", name, exc_info=True)

    def add(self, name: str, value: int = 1, attributes: dict[str, str] | None = None) -> None:
        """Add ``value`` to the counter ``name`` (a no-op while Gym's export is off)."""
        instruments = self._bound()
        if instruments is not None:
            try:
                instruments[name].add(value, attributes=attributes or {})
            except Exception:
                logger.debug("could not add to %s", name, exc_info=True)

    def bind(self) -> bool:
        """Create the instruments now if Gym exports (so the gauges report before the first checkpoint)."""
        return self._bound() is not None


def _callback(read: Callable[[], Iterable[tuple[float, dict[str, str]]]]) -> Callable[[Any], Iterable[Any]]:
    def observe(_options: Any) -> Iterable[Any]:
        from opentelemetry.metrics import Observation

        try:
            return [Observation(value, attributes) for value, attributes in read()]
        except Exception:  # an export must not fail on one gauge
            logger.debug("could not observe a checkpoint gauge", exc_info=True)
            return []

    return observe
