"""Every checkpoint metric: its OpenTelemetry name and UCUM unit, Prometheus name, type, labels, meaning.

docs/telemetry.md's table lists them from here; ``metrics.ServerMetrics`` exposes them as Prometheus
text and ``gym_export.GymMeter`` on Gym's own meter.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["METRICS", "MetricName"]


@dataclass(frozen=True)
class MetricName:
    """One metric: its OpenTelemetry name and UCUM unit, its Prometheus name, type, labels and meaning."""

    otel: str
    unit: str
    prometheus: str
    type: str
    labels: tuple[str, ...]
    meaning: str


METRICS: tuple[MetricName, ...] = (
    MetricName(
        "gym.checkpoint.duration",
        "s",
        "gym_checkpoint_duration_seconds",
        "histogram",
        ("phase",),
        "time this server took to answer a control call, by phase (prepare, commit, restore, resume, retire, forget)",
    ),
    MetricName(
        "gym.checkpoint.stage.duration",
        "s",
        "gym_checkpoint_stage_duration_seconds",
        "histogram",
        ("stage",),
        "time of one stage of a control operation (wait_ready, export, write, read, install)",
    ),
    MetricName(
        "gym.checkpoint.completed",
        "{checkpoint}",
        "gym_checkpoint_completed_total",
        "counter",
        (),
        "checkpoints this server wrote and published (a commit whose manifest is durable)",
    ),
    MetricName(
        "gym.checkpoint.restored",
        "{restore}",
        "gym_checkpoint_restored_total",
        "counter",
        (),
        "restores this server read and installed",
    ),
    MetricName(
        "gym.checkpoint.failed",
        "{call}",
        "gym_checkpoint_failed_total",
        "counter",
        ("phase", "code"),
        "control calls that failed, by phase and error code (docs/protocol.md codes; internal: anything else)",
    ),
    MetricName(
        "gym.checkpoint.in_progress",
        "{operation}",
        "gym_checkpoint_in_progress",
        "gauge",
        ("operation",),
        "1 while a checkpoint or restore is active on this server (prepare to resume), else 0",
    ),
    MetricName(
        "gym.checkpoint.last_success.time",
        "s",
        "gym_checkpoint_last_success_time_seconds",
        "gauge",
        (),
        "Unix time of this server's last published checkpoint (absent until the first one)",
    ),
    MetricName(
        "gym.checkpoint.size",
        "By",
        "gym_checkpoint_size_bytes",
        "gauge",
        (),
        "size of the records file of this server's last published checkpoint",
    ),
    MetricName(
        "gym.checkpoint.records",
        "{record}",
        "gym_checkpoint_records",
        "gauge",
        (),
        "records in this server's last published checkpoint",
    ),
    MetricName(
        "gym.checkpoint.episodes",
        "{episode}",
        "gym_checkpoint_episodes",
        "gauge",
        (),
        "episodes in this server's last published checkpoint",
    ),
    MetricName(
        "gym.checkpoint.admission.closed.duration",
        "s",
        "gym_checkpoint_admission_closed_duration_seconds",
        "histogram",
        (),
        "how long admission stayed closed (the pause this server imposed), per checkpoint or restore",
    ),
    MetricName(
        "gym.checkpoint.admission.closed",
        "1",
        "gym_checkpoint_admission_closed",
        "gauge",
        (),
        "1 while admission is closed (new data requests park), else 0",
    ),
    MetricName(
        "gym.checkpoint.parked.requests",
        "{request}",
        "gym_checkpoint_parked_requests",
        "gauge",
        (),
        "data requests parked at the admission gate right now",
    ),
    MetricName(
        "gym.checkpoint.parked.duration",
        "s",
        "gym_checkpoint_parked_duration_seconds",
        "histogram",
        (),
        "how long each parked data request waited at the admission gate",
    ),
    MetricName(
        "gym.checkpoint.refused.requests",
        "{request}",
        "gym_checkpoint_refused_requests_total",
        "counter",
        (),
        "data requests the admission gate refused stale_attempt (their attempt was retired)",
    ),
    MetricName(
        "gym.checkpoint.held.responses",
        "{response}",
        "gym_checkpoint_held_responses",
        "gauge",
        (),
        "model responses held at closed admission right now (model servers; 0 elsewhere)",
    ),
    MetricName(
        "gym.checkpoint.restarts",
        "{episode}",
        "gym_checkpoint_restarts_total",
        "counter",
        (),
        "episodes a prepare reported as restarts (they start over instead of continuing)",
    ),
    MetricName(
        "gym.checkpoint.lease.expiries",
        "{expiry}",
        "gym_checkpoint_lease_expiries_total",
        "counter",
        (),
        "leases that expired without a controller call (the server resumed on its own)",
    ),
)
