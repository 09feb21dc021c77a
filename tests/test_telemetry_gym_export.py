"""The checkpoint metrics on Gym's own OpenTelemetry meter where Gym's metrics export is on (docs/telemetry.md).

Gym 0.7.0 exports through nemo-lens, whose pinned build is not installable here (PyPI's 0.1.0 lacks
what Gym imports), so the one thing standing in for it is the handle lens would give Gym: an
OpenTelemetry SDK meter provider with an in-memory reader, put where Gym's ``init_telemetry`` puts
its handle. Everything else is real: the control plane, its storage, Gym's own lookup functions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from control_support import Harness, close_harness, make_harness, wire
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from nemo_gym_checkpoint_plugin._telemetry import METRICS

Points = dict[str, list[tuple[dict[str, Any], Any]]]


@pytest.fixture
def gym_export(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemoryMetricReader]:
    """Gym's metrics export on: its telemetry handle (as lens builds it) over an in-memory reader."""
    from nemo_gym.telemetry import setup

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    handle = SimpleNamespace(meter=provider.get_meter("nemo.lens"), is_exporting=True)
    monkeypatch.setattr(setup, "_TELEMETRY_HANDLE", handle)
    monkeypatch.setattr(setup, "_METRICS_EXPORTING", True)
    yield reader
    provider.shutdown()


def points(reader: InMemoryMetricReader) -> Points:
    found: Points = {}
    data = reader.get_metrics_data()
    if data is None:
        return found
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    found.setdefault(metric.name, []).append((dict(point.attributes or {}), point))
    return found


def one(found: Points, name: str, **attributes: str) -> Any:
    matching = [point for attrs, point in found.get(name, []) if attrs == attributes]
    assert len(matching) == 1, (name, attributes, found.get(name))
    return matching[0]


@pytest.fixture
async def h(tmp_path: Path, gym_export: InMemoryMetricReader) -> AsyncIterator[Harness]:
    harness = await make_harness(tmp_path)
    yield harness
    await close_harness(harness)


async def test_a_checkpoint_and_a_restore_reach_gyms_meter(
    h: Harness, gym_export: InMemoryMetricReader, tmp_path: Path
) -> None:
    h.participant.add("r1", "r2", "r3")
    before = points(gym_export)
    assert one(before, "gym.checkpoint.admission.closed").value == 0  # gauges report before any checkpoint
    assert "gym.checkpoint.last_success.time" not in before  # nothing published: no 1970 timestamp

    await h.call("prepare", checkpoint_id="c1")
    during = points(gym_export)
    assert one(during, "gym.checkpoint.in_progress", operation="checkpoint").value == 1
    assert one(during, "gym.checkpoint.admission.closed").value == 1
    reply = await h.call(
        "commit", checkpoint_id="c1", checkpoint_dir=str(h.directory), episode_ids=[wire("r1"), wire("r2")]
    )
    await h.call("resume", checkpoint_id="c1")
    await h.error("prepare", "stale_checkpoint", checkpoint_id="c1")

    found = points(gym_export)
    for phase in ("prepare", "commit", "resume"):
        assert one(found, "gym.checkpoint.duration", phase=phase).count >= 1
    assert one(found, "gym.checkpoint.duration", phase="prepare").count == 2
    for stage in ("wait_ready", "export", "write"):
        assert one(found, "gym.checkpoint.stage.duration", stage=stage).count == 1
    assert one(found, "gym.checkpoint.completed").value == 1
    assert one(found, "gym.checkpoint.failed", phase="prepare", code="stale_checkpoint").value == 1
    assert one(found, "gym.checkpoint.admission.closed.duration").count == 1
    assert one(found, "gym.checkpoint.records").value == reply["manifest"]["record_count"] == 2
    assert one(found, "gym.checkpoint.episodes").value == 2
    records = h.directory / "gym" / "environment" / "env_one" / reply["manifest"]["records_file"]
    assert one(found, "gym.checkpoint.size").value == records.stat().st_size > 0
    assert one(found, "gym.checkpoint.in_progress", operation="checkpoint").value == 0
    # Never a checkpoint id or an episode key among the attributes.
    for series in found.values():
        for attrs, _point in series:
            assert not {"c1", "r1", "r2"} & {str(v) for v in attrs.values()}

    target = await make_harness(tmp_path / "target")
    try:
        await target.call(
            "restore", checkpoint_id="r-1", checkpoint_dir=str(h.directory), episode_ids=[wire("r1"), wire("r2")]
        )
        await target.call("resume", checkpoint_id="r-1")
    finally:
        await close_harness(target)
    after = points(gym_export)
    assert one(after, "gym.checkpoint.restored").value == 1
    assert one(after, "gym.checkpoint.stage.duration", stage="read").count == 1
    assert one(after, "gym.checkpoint.stage.duration", stage="install").count == 1


async def test_every_documented_metric_is_an_instrument(h: Harness, gym_export: InMemoryMetricReader) -> None:
    h.participant.add("r1")
    await h.checkpoint("c1", ["r1"])
    await h.call("resume", checkpoint_id="c1")
    found = points(gym_export)
    # Every metric of the table reports once there is something to report (the restore-only and
    # failure-only ones are counted in the test above).
    reported = {"gym.checkpoint.restored", "gym.checkpoint.failed", "gym.checkpoint.restarts"}
    for metric in METRICS:
        if metric.otel not in reported and metric.otel != "gym.checkpoint.parked.duration":
            assert metric.otel in found, metric.otel


async def test_nothing_reaches_a_meter_while_gyms_export_is_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nemo_gym.telemetry import setup

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    # Telemetry initialised for traces only: a handle, but metrics not exported.
    monkeypatch.setattr(setup, "_TELEMETRY_HANDLE", SimpleNamespace(meter=provider.get_meter("x"), is_exporting=True))
    monkeypatch.setattr(setup, "_METRICS_EXPORTING", False)
    harness = await make_harness(tmp_path)
    try:
        harness.participant.add("r1")
        await harness.checkpoint("c1", ["r1"])
        await harness.call("resume", checkpoint_id="c1")
    finally:
        await close_harness(harness)
    assert points(reader) == {}
    provider.shutdown()
