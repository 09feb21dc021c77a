"""Checkpoint metrics (docs/telemetry.md) read from the metrics route of an in-process control plane.

Every assertion reads the Prometheus text the route serves (parsed with prometheus_client's own
parser), never the plane's attributes: what a scrape sees is what is tested.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from control_support import AUTH, Harness, close_harness, deadline, make_harness, wait_until, wire
from fastapi import FastAPI
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from nemo_gym_checkpoint_plugin._admission import Admission, RetiredMarks
from nemo_gym_checkpoint_plugin._errors import InvalidPhase
from nemo_gym_checkpoint_plugin._gate import install_gate
from nemo_gym_checkpoint_plugin._routes import CONTROL_PREFIX
from nemo_gym_checkpoint_plugin._telemetry import METRICS

METRICS_PATH = f"{CONTROL_PREFIX}/metrics"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def scrape(h: Harness) -> tuple[Samples, str]:
    response = await h.client.get(METRICS_PATH, headers=AUTH)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text), response.text


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await make_harness(tmp_path)
    yield harness
    await close_harness(harness)


async def test_a_checkpoint_shows_in_the_scrape(h: Harness) -> None:
    h.participant.add("r1", "r2", "r3")
    before, _ = await scrape(h)
    assert value(before, "gym_checkpoint_completed_total") == 0
    assert ("gym_checkpoint_last_success_time_seconds", ()) not in before  # no success yet: no 1970 timestamp

    await h.call("prepare", checkpoint_id="c1")
    during, _ = await scrape(h)
    assert value(during, "gym_checkpoint_in_progress", operation="checkpoint") == 1
    assert value(during, "gym_checkpoint_admission_closed") == 1
    started = time.time()
    reply = await h.call(
        "commit", checkpoint_id="c1", checkpoint_dir=str(h.directory), episode_ids=[wire("r1"), wire("r2")]
    )
    await h.call("resume", checkpoint_id="c1")

    samples, text = await scrape(h)
    assert value(samples, "gym_checkpoint_completed_total") == 1
    for phase in ("prepare", "commit", "resume"):
        assert value(samples, "gym_checkpoint_duration_seconds_count", phase=phase) == 1
    for stage in ("wait_ready", "export", "write"):
        assert value(samples, "gym_checkpoint_stage_duration_seconds_count", stage=stage) == 1
    manifest = reply["manifest"]
    records = h.directory / "gym" / "environment" / "env_one" / manifest["records_file"]
    assert value(samples, "gym_checkpoint_size_bytes") == records.stat().st_size > 0
    assert value(samples, "gym_checkpoint_records") == manifest["record_count"] == 2
    assert value(samples, "gym_checkpoint_episodes") == 2
    assert started - 1 <= value(samples, "gym_checkpoint_last_success_time_seconds") <= time.time()
    assert value(samples, "gym_checkpoint_admission_closed_duration_seconds_count") == 1
    assert value(samples, "gym_checkpoint_in_progress", operation="checkpoint") == 0
    assert value(samples, "gym_checkpoint_admission_closed") == 0
    # Never a checkpoint id or an episode key as a label (nor anywhere in the text).
    assert "c1" not in text and "r1" not in text


async def test_every_documented_metric_is_exposed(h: Harness) -> None:
    _, text = await scrape(h)
    families = {family.name for family in text_string_to_metric_families(text)}
    for metric in METRICS:
        # The parser names a counter family without its _total suffix.
        name = metric.prometheus.removesuffix("_total") if metric.type == "counter" else metric.prometheus
        assert name in families, metric.prometheus


async def test_failed_calls_are_counted_by_phase_and_code(h: Harness) -> None:
    await h.error("commit", "invalid_phase", checkpoint_id="c1", checkpoint_dir=str(h.directory), episode_ids=None)
    await h.call("prepare", checkpoint_id="c1")
    await h.error("prepare", "checkpoint_conflict", checkpoint_id="c2")
    await h.call("resume", checkpoint_id="c1")
    await h.error("prepare", "stale_checkpoint", checkpoint_id="c1")
    samples, _ = await scrape(h)
    assert value(samples, "gym_checkpoint_failed_total", phase="commit", code="invalid_phase") == 1
    assert value(samples, "gym_checkpoint_failed_total", phase="prepare", code="checkpoint_conflict") == 1
    assert value(samples, "gym_checkpoint_failed_total", phase="prepare", code="stale_checkpoint") == 1
    assert value(samples, "gym_checkpoint_completed_total") == 0
    assert value(samples, "gym_checkpoint_duration_seconds_count", phase="prepare") == 3


async def test_a_failing_export_counts_under_its_code(h: Harness) -> None:
    h.participant.add("r1")
    h.participant.export_error = InvalidPhase("not now")
    await h.call("prepare", checkpoint_id="c1")
    await h.error("commit", "invalid_phase", checkpoint_id="c1", checkpoint_dir=str(h.directory), episode_ids=None)
    await h.error("commit", "export_failed", checkpoint_id="c1", checkpoint_dir=str(h.directory), episode_ids=None)
    samples, _ = await scrape(h)
    assert value(samples, "gym_checkpoint_failed_total", phase="commit", code="invalid_phase") == 1
    assert value(samples, "gym_checkpoint_failed_total", phase="commit", code="export_failed") == 1
    assert value(samples, "gym_checkpoint_completed_total") == 0


async def test_restarts_and_a_restore_are_counted(tmp_path: Path) -> None:
    source = await make_harness(tmp_path / "source")
    try:
        source.participant.add("r1", "r2")
        source.participant.restarts = {"r2"}
        await source.checkpoint("c1", ["r1"])
        await source.call("resume", checkpoint_id="c1")
        samples, _ = await scrape(source)
        assert value(samples, "gym_checkpoint_restarts_total") == 1
    finally:
        await close_harness(source)
    target = await make_harness(tmp_path / "target")
    try:
        await target.call(
            "restore", checkpoint_id="restore-1", checkpoint_dir=str(source.directory), episode_ids=[wire("r1")]
        )
        samples, _ = await scrape(target)
        assert value(samples, "gym_checkpoint_restored_total") == 1
        assert value(samples, "gym_checkpoint_in_progress", operation="restore") == 1
        for stage in ("read", "install"):
            assert value(samples, "gym_checkpoint_stage_duration_seconds_count", stage=stage) == 1
        await target.call("resume", checkpoint_id="restore-1")
        samples, _ = await scrape(target)
        assert value(samples, "gym_checkpoint_admission_closed_duration_seconds_count") == 1
        assert value(samples, "gym_checkpoint_in_progress", operation="restore") == 0
    finally:
        await close_harness(target)


async def test_a_lease_expiry_is_counted(tmp_path: Path) -> None:
    h = await make_harness(tmp_path, grace_seconds=0.05)
    try:
        await h.call("prepare", checkpoint_id="c1", deadline_ts=deadline(0.3))
        await wait_until(lambda: h.plane.phase == "idle", timeout=5, what="the self-resume")
        samples, _ = await scrape(h)
        assert value(samples, "gym_checkpoint_lease_expiries_total") == 1
        assert value(samples, "gym_checkpoint_duration_seconds_count", phase="resume") == 1
    finally:
        await close_harness(h)


async def test_parked_requests_are_current_and_timed(h: Harness) -> None:
    data = FastAPI()

    @data.get("/data")
    async def route() -> dict[str, bool]:
        return {"ok": True}

    counters = install_gate(data, h.plane.admission, h.plane.marks)
    h.plane.telemetry.metrics.watch_gate(counters)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=data), base_url="http://data.test")
    try:
        await h.call("prepare", checkpoint_id="c1")
        parked = asyncio.create_task(client.get("/data"))
        await wait_until(lambda: counters.parked == 1, what="the request to park")
        samples, _ = await scrape(h)
        assert value(samples, "gym_checkpoint_parked_requests") == 1
        await h.call("resume", checkpoint_id="c1")
        assert (await asyncio.wait_for(parked, 5)).status_code == 200
        samples, _ = await scrape(h)
        assert value(samples, "gym_checkpoint_parked_requests") == 0
        assert value(samples, "gym_checkpoint_parked_duration_seconds_count") == 1
    finally:
        await client.aclose()


async def test_refused_requests_are_counted(h: Harness) -> None:
    data = FastAPI()

    @data.get("/ng-rollout/{key}/data")
    async def route(key: str) -> dict[str, bool]:
        return {"ok": True}

    h.plane.telemetry.metrics.watch_gate(install_gate(data, h.plane.admission, h.plane.marks))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=data), base_url="http://data.test")
    try:
        assert (await client.get("/ng-rollout/r9/data")).status_code == 200
        await h.call("retire", checkpoint_id="x", episode_ids=[wire("r9")])
        for _ in range(2):
            refused = await client.get("/ng-rollout/r9/data")
            assert refused.status_code == 409 and refused.json()["error"]["code"] == "stale_attempt"
        samples, _ = await scrape(h)
        assert value(samples, "gym_checkpoint_refused_requests_total") == 2
    finally:
        await client.aclose()


async def test_held_responses_come_from_the_ready_counts(tmp_path: Path) -> None:
    class Held:
        from nemo_gym_checkpoint_plugin._markers import hookimpl

        @hookimpl
        def ready(self, checkpoint_id: str | None) -> object:
            from nemo_gym_checkpoint_plugin._control import Readiness

            return Readiness(counts={"model_responses_held": 3})

    h = await make_harness(tmp_path, extra_plugins=(Held(),))
    try:
        samples, _ = await scrape(h)
        assert value(samples, "gym_checkpoint_held_responses") == 3
    finally:
        await close_harness(h)


async def test_the_metrics_route_needs_the_token(h: Harness) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = await h.client.get(METRICS_PATH, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "unauthorized"


async def test_each_plane_has_its_own_registry(tmp_path: Path) -> None:
    one = await make_harness(tmp_path / "one")
    two = await make_harness(tmp_path / "two")
    try:
        one.participant.add("r1")
        await one.checkpoint("c1", None)
        assert value((await scrape(one))[0], "gym_checkpoint_completed_total") == 1
        assert value((await scrape(two))[0], "gym_checkpoint_completed_total") == 0
        # Nothing lands in prometheus_client's process-wide default registry.
        assert REGISTRY.get_sample_value("gym_checkpoint_completed_total") is None
        assert one.plane.telemetry.metrics.registry is not REGISTRY
    finally:
        await close_harness(one)
        await close_harness(two)


def test_no_metric_label_names_an_id() -> None:
    for metric in METRICS:
        assert not {"checkpoint_id", "episode", "episode_id", "rollout_id"} & set(metric.labels), metric
        assert metric.otel.startswith("gym.checkpoint.") and metric.prometheus.startswith("gym_checkpoint_")


async def test_marks_stay_untouched_by_a_scrape(h: Harness) -> None:
    # A scrape reads; it never changes the plane (phase, admission, marks).
    await scrape(h)
    assert h.plane.phase == "idle" and h.plane.admission.is_open and len(h.plane.marks) == 0
    assert isinstance(h.plane.marks, RetiredMarks) and isinstance(h.plane.admission, Admission)


def test_docs_name_every_metric_and_span_attribute() -> None:
    from nemo_gym_checkpoint_plugin._telemetry import spans

    page = (Path(__file__).resolve().parent.parent / "docs" / "telemetry.md").read_text(encoding="utf-8")
    for metric in METRICS:
        row = f"| `{metric.otel}` | `{metric.unit}` | `{metric.prometheus}` | {metric.type} |"
        assert row in page, row
    for attribute in spans.ATTRIBUTES:
        assert f"| `{attribute}` |" in page, attribute
    for stage in ("wait_ready", "export", "write", "read", "install"):
        assert f"`checkpoint {stage}`" in page, stage
