"""Checkpoint spans read from real Gym server processes: checkpoint, SIGKILL every group, restore.

The demo's deployment (every server wrapped, each in its own process group) runs as plain processes
with ``tests/lens_standin`` on their ``PYTHONPATH``: it stands in for nemo-lens, which Gym 0.7.0 sets
its tracer provider and span groups up with and which cannot be installed here (docs/telemetry.md
"Spans"), by exporting each ended span to a file per process. The controller is the coordination
library in this process, its spans in an in-memory exporter. What is checked is what an operator's
trace backend would show: one trace per operation across the processes, each server's ``serve`` span
a child of the controller's call to that server, its stages below it, and the figures on them.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from nemo_gym_checkpoint_plugin._telemetry import spans
from nemo_gym_checkpoint_plugin.coordination import commit, discover, prepare, restore, resume
from nemo_gym_checkpoint_plugin.testing import deployment as deployment_module
from nemo_gym_checkpoint_plugin.testing.crash_scenario import new_deployment
from nemo_gym_checkpoint_plugin.testing.gym_config import GYM_SERVERS
from nemo_gym_checkpoint_plugin.testing.harness import GymHarness, send_rollout

pytestmark = pytest.mark.slow

TOKEN = "spans-process-token"
STANDIN = Path(__file__).parent / "lens_standin"


@pytest.fixture
def plain_processes() -> Iterator[None]:
    """Servers started as fresh interpreters (a zygote's fork would not run the stand-in at start-up)."""
    previous = deployment_module._session_zygote
    deployment_module.use_zygote(None)
    try:
        yield
    finally:
        deployment_module.use_zygote(previous)


def _server_spans(directory: Path) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for path in sorted(directory.glob("spans.*")):
        found.extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return found


def _caller(span: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> str:
    """The first ancestor of a server span that no server process recorded (the controller's)."""
    parent = span["parent_id"]
    while parent in by_id:
        assert by_id[parent]["trace_id"] == span["trace_id"] and by_id[parent]["pid"] == span["pid"]
        parent = by_id[parent]["parent_id"]
    assert parent is not None, span
    return str(parent)


def _hex(span: ReadableSpan) -> tuple[str, str]:
    assert span.context is not None
    return format(span.context.trace_id, "032x"), format(span.context.span_id, "016x")


async def test_server_spans_join_the_controllers_trace_across_a_crash(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    exporter: InMemorySpanExporter,
    plain_processes: None,
) -> None:
    span_dir = tmp_path / "spans"
    span_dir.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(STANDIN), os.environ.get("PYTHONPATH")) if p))
    deployment = new_deployment(
        tmp_path / "deployment",
        TOKEN,
        extra_env={
            "NG_CHECKPOINT_TEST_SPAN_FILE": str(span_dir / "spans"),
            "NEMO_GYM_OTEL_SPAN_GROUPS": "default,checkpoint",
        },
    )
    deployment.start()
    harness = GymHarness(deployment)
    checkpoint_dir = tmp_path / "ckpt"
    try:
        await harness.fake.hold(match="(rollout sp-0)", count=1, step=1)
        in_flight = asyncio.ensure_future(send_rollout(harness.env_url, "sp-0"))
        try:
            await harness.fake.wait_for(lambda s: s["held"] == 1, timeout=60, what="the held model call")
            coordinator = await discover(deployment.config, TOKEN)
            async with coordinator:
                prepared = await prepare(coordinator, "sp-ckpt", timeout=60)
                assert prepared.ready, prepared.to_json()
                scope = prepared.continued(["sp-0"])
                committed = await commit(coordinator, "sp-ckpt", str(checkpoint_dir), scope, timeout=60)
                await resume(coordinator, "sp-ckpt", timeout=60)
        finally:
            await harness.fake.release()
        before_crash = {(s["pid"], s["name"]) for s in _server_spans(span_dir)}
        killed = harness.crash()
        assert set(killed) >= set(GYM_SERVERS)
        await asyncio.gather(in_flight, return_exceptions=True)
        await asyncio.to_thread(harness.restart)
        coordinator = await discover(deployment.config, TOKEN)
        async with coordinator:
            await restore(coordinator, "sp-restore", str(checkpoint_dir), scope, timeout=60)
            await resume(coordinator, "sp-restore", timeout=60)
    finally:
        deployment.stop()

    server = _server_spans(span_dir)
    # What the killed processes ended before the SIGKILL is all there (exported as each span ended).
    assert before_crash <= {(s["pid"], s["name"]) for s in server}
    by_id = {s["span_id"]: s for s in server}
    calls = {_hex(s)[1]: s for s in exporter.get_finished_spans() if s.name.endswith(" call") and s.attributes}
    for operation, checkpoint_id in (
        ("prepare", "sp-ckpt"),
        ("commit", "sp-ckpt"),
        ("resume", "sp-ckpt"),
        ("restore", "sp-restore"),
        ("resume", "sp-restore"),
    ):
        served = [
            s
            for s in server
            if s["name"] == f"checkpoint {operation} serve" and s["attributes"][spans.CHECKPOINT_ID] == checkpoint_id
        ]
        assert sorted(s["attributes"][spans.PARTICIPANT_INSTANCE] for s in served) == sorted(GYM_SERVERS), operation
        for s in served:
            # A child of the controller's call to this very server (through FastAPI's own request spans).
            call = calls[_caller(s, by_id)]
            assert call.name == f"checkpoint {operation} call"
            assert call.attributes is not None
            assert call.attributes[spans.PARTICIPANT_INSTANCE] == s["attributes"][spans.PARTICIPANT_INSTANCE]
            assert _hex(call)[0] == s["trace_id"]
            assert s["attributes"][spans.OUTCOME] == "ok"
    # One trace per operation: every server's commit below the controller's one commit span.
    (commit_op,) = [s for s in exporter.get_finished_spans() if s.name == "checkpoint commit"]
    commit_trace = _hex(commit_op)[0]
    for s in server:
        if s["name"] in ("checkpoint export", "checkpoint write"):
            parent = by_id[s["parent_id"]]
            assert parent["name"] == "checkpoint commit serve" and s["trace_id"] == commit_trace
        if s["name"] in ("checkpoint read", "checkpoint install"):
            assert by_id[s["parent_id"]]["name"] == "checkpoint restore serve"
        if s["name"] == "checkpoint wait_ready":
            assert by_id[s["parent_id"]]["name"] == "checkpoint prepare serve"
    stages = {(s["name"], s["attributes"].get(spans.PARTICIPANT_INSTANCE)) for s in server}
    for instance in GYM_SERVERS:
        for stage in ("wait_ready", "export", "write", "read", "install"):
            assert (f"checkpoint {stage}", instance) in stages, (stage, instance)
    # The figures on each server's commit span are its manifest's and its records file's.
    for s in server:
        if s["name"] == "checkpoint commit serve":
            instance = s["attributes"][spans.PARTICIPANT_INSTANCE]
            manifest = committed.manifests[instance]
            records = checkpoint_dir / "gym" / manifest["kind"] / manifest["instance"] / manifest["records_file"]
            assert s["attributes"][spans.RECORDS] == manifest["record_count"], instance
            assert s["attributes"][spans.BYTES] == records.stat().st_size, instance
