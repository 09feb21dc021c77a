"""Checkpoint spans (docs/telemetry.md "Spans"), read from the OpenTelemetry SDK's in-memory exporter.

Server side: the control plane's spans on an in-process app. Controller and servers together: the
coordination library calling participant apps served by uvicorn on 127.0.0.1 (real HTTP, in this
process so one exporter sees both sides), its ``traceparent`` parenting each server's spans.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from control_support import TOKEN, Harness, close_harness, make_harness, wire
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from nemo_gym_checkpoint_plugin._telemetry import spans
from nemo_gym_checkpoint_plugin.coordination import (
    ControlTransport,
    CoordinationError,
    Coordinator,
    Participant,
    commit,
    prepare,
    resume,
)


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await make_harness(tmp_path)
    yield harness
    await close_harness(harness)


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def one(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    (found,) = named(exporter, name)
    return found


def parent_of(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


async def test_a_checkpoint_on_a_server_is_its_calls_with_their_stages(
    h: Harness, exporter: InMemorySpanExporter
) -> None:
    h.participant.add("r1", "r2")
    reply = await h.checkpoint("c1", ["r1"])
    await h.call("resume", checkpoint_id="c1")

    prepare_span = one(exporter, "checkpoint prepare serve")
    commit_span = one(exporter, "checkpoint commit serve")
    one(exporter, "checkpoint resume serve")
    assert parent_of(one(exporter, "checkpoint wait_ready")) == prepare_span.context.span_id
    for stage in ("export", "write"):
        stage_span = one(exporter, f"checkpoint {stage}")
        assert parent_of(stage_span) == commit_span.context.span_id
        assert stage_span.attributes[spans.STAGE] == stage
    records = h.directory / "gym" / "environment" / "env_one" / reply["manifest"]["records_file"]
    attributes = commit_span.attributes
    assert attributes[spans.CHECKPOINT_ID] == "c1" and attributes[spans.OPERATION] == "commit"
    assert attributes[spans.PARTICIPANT_KIND] == "environment"
    assert attributes[spans.PARTICIPANT_INSTANCE] == "env_one"
    assert attributes[spans.EPISODES] == 1 and attributes[spans.RECORDS] == 1
    assert attributes[spans.BYTES] == records.stat().st_size
    assert attributes[spans.OUTCOME] == "ok" and spans.ERROR_TYPE not in attributes
    assert prepare_span.attributes[spans.OUTCOME] == "ok"


async def test_a_refused_call_carries_its_error_code(h: Harness, exporter: InMemorySpanExporter) -> None:
    await h.error("commit", "invalid_phase", checkpoint_id="c1", checkpoint_dir=str(h.directory), episode_ids=None)
    failed = one(exporter, "checkpoint commit serve")
    assert failed.attributes[spans.OUTCOME] == "error"
    assert failed.attributes[spans.ERROR_TYPE] == "invalid_phase"
    assert failed.status.status_code is StatusCode.ERROR


async def test_a_prepare_left_unready_says_so(h: Harness, exporter: InMemorySpanExporter) -> None:
    h.participant.add("r1")
    h.participant.blockers = {"r1"}
    await h.call("prepare", checkpoint_id="c1", deadline_ts=time.time() + 0.3)
    assert one(exporter, "checkpoint prepare serve").attributes[spans.OUTCOME] == "not_ready"


async def test_a_restore_is_read_then_install(tmp_path: Path, exporter: InMemorySpanExporter) -> None:
    source = await make_harness(tmp_path / "source")
    try:
        source.participant.add("r1", "r2")
        await source.checkpoint("c1", None)
    finally:
        await close_harness(source)
    target = await make_harness(tmp_path / "target")
    try:
        await target.call(
            "restore", checkpoint_id="back", checkpoint_dir=str(source.directory), episode_ids=[wire("r1"), wire("r2")]
        )
    finally:
        await close_harness(target)
    restore_span = one(exporter, "checkpoint restore serve")
    for stage in ("read", "install"):
        assert one(exporter, f"checkpoint {stage}").context.trace_id == restore_span.context.trace_id
    assert parent_of(one(exporter, "checkpoint read")) == restore_span.context.span_id
    assert restore_span.attributes[spans.RECORDS] == 2 and restore_span.attributes[spans.EPISODES] == 2


async def test_with_the_group_off_there_are_no_spans(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    # A provider at hand, but the selection is Gym's (no nemo-lens here: every group is off).
    monkeypatch.setattr(spans._SELECTION, "provider", provider)
    assert not spans.enabled()
    h.participant.add("r1")
    await h.checkpoint("c1", None)
    assert memory.get_finished_spans() == ()


def test_the_selection_is_gyms_span_group_check(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def is_span_group_enabled(group: str) -> bool:
        asked.append(group)
        return True

    monkeypatch.setattr(spans._SELECTION, "_gym", is_span_group_enabled)
    assert spans.enabled() and asked == ["checkpoint"]


def test_the_group_is_registered_with_nemo_lens(monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[tuple[str, dict[str, Any]]] = []

    class SpanRegistry:
        @staticmethod
        def register(namespace: str, **kwargs: Any) -> None:
            registered.append((namespace, kwargs))

    groups = types.ModuleType("nemo.lens.groups")
    groups.SpanRegistry = SpanRegistry  # type: ignore[attr-defined]
    for name in ("nemo", "nemo.lens"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "nemo.lens.groups", groups)
    assert spans.register_span_group()
    assert registered == [
        ("nemo_gym_checkpoint", {"groups": frozenset({"checkpoint"}), "presets": {}, "allow_override": True})
    ]
    monkeypatch.delitem(sys.modules, "nemo.lens.groups")
    assert not spans.register_span_group()


async def _serve(app: Any) -> tuple[uvicorn.Server, asyncio.Task[None], str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)  # wait-ok: polling interval of uvicorn's startup (bounded by the test timeout)
    return server, task, f"http://127.0.0.1:{port}"


async def test_the_controllers_spans_parent_every_participants(tmp_path: Path, exporter: InMemorySpanExporter) -> None:
    harnesses = [await make_harness(tmp_path / f"env-{i}", instance=f"env-{i}") for i in range(2)]
    served = [await _serve(harness.app) for harness in harnesses]
    try:
        for harness in harnesses:
            harness.participant.add("r1")
        participants = [
            Participant(name=f"env-{i}", url=url, kind="environment", instance=f"env-{i}")
            for i, (_, _, url) in enumerate(served)
        ]
        async with Coordinator(participants, ControlTransport(TOKEN)) as coordinator:
            result = await prepare(coordinator, "c1", timeout=10)
            assert result.ready
            await commit(coordinator, "c1", str(tmp_path / "ckpt"), [wire("r1")], timeout=10)
            await resume(coordinator, "c1", timeout=10)
    finally:
        for server, task, _ in served:
            server.should_exit = True
            await task
        for harness in harnesses:
            await close_harness(harness)

    for operation in ("prepare", "commit", "resume"):
        root = one(exporter, f"checkpoint {operation}")
        assert root.kind is SpanKind.INTERNAL and root.attributes[spans.CHECKPOINT_ID] == "c1"
        assert root.attributes[spans.PARTICIPANTS] == 2 and root.attributes[spans.OUTCOME] == "ok"
        calls = named(exporter, f"checkpoint {operation} call")
        assert len(calls) == 2
        assert {c.attributes[spans.PARTICIPANT_INSTANCE] for c in calls} == {"env-0", "env-1"}
        serves = named(exporter, f"checkpoint {operation} serve")
        assert len(serves) == 2
        for call in calls:
            assert call.kind is SpanKind.CLIENT and parent_of(call) == root.context.span_id
            assert call.context.trace_id == root.context.trace_id
        # Each server's span is a child of one call span, through the traceparent it carried.
        assert sorted(parent_of(s) or 0 for s in serves) == sorted(c.context.span_id for c in calls)
        assert {s.context.trace_id for s in serves} == {root.context.trace_id}
    commit_root = one(exporter, "checkpoint commit")
    assert commit_root.attributes[spans.EPISODES] == 1
    for call in named(exporter, "checkpoint commit call"):
        assert call.attributes[spans.EPISODES] == 1 and call.attributes[spans.RECORDS] == 1


async def test_a_refusing_participant_marks_the_operation_failed(
    tmp_path: Path, exporter: InMemorySpanExporter
) -> None:
    harness = await make_harness(tmp_path)
    server, task, url = await _serve(harness.app)
    try:
        participant = Participant(name="env", url=url, kind="environment", instance="env")
        async with Coordinator([participant], ControlTransport(TOKEN)) as coordinator:
            with pytest.raises(CoordinationError):
                await commit(coordinator, "c1", str(tmp_path / "ckpt"), [wire("r1")], timeout=10)
    finally:
        server.should_exit = True
        await task
        await close_harness(harness)
    root = one(exporter, "checkpoint commit")
    assert root.attributes[spans.OUTCOME] == "failed" and root.attributes[spans.ERROR_TYPE] == "invalid_phase"
    call = one(exporter, "checkpoint commit call")
    assert call.attributes[spans.OUTCOME] == "error" and call.attributes[spans.ERROR_TYPE] == "invalid_phase"
    assert parent_of(one(exporter, "checkpoint commit serve")) == call.context.span_id


@pytest.mark.parametrize("enabled", [True, False])
def test_a_checkpointed_server_declares_the_group_before_gym_sets_up_telemetry(
    monkeypatch: pytest.MonkeyPatch, enabled: bool
) -> None:
    from nemo_gym_checkpoint_plugin import mixin
    from nemo_gym_checkpoint_plugin._settings import CheckpointSettings

    order: list[str] = []

    class GymServer:
        @classmethod
        def load_config_from_global_config(cls) -> None:
            return None

        @classmethod
        def run_webserver(cls) -> None:
            order.append("gym run_webserver (init_telemetry)")

    class Server(mixin.CheckpointMixin, GymServer):
        pass

    monkeypatch.setattr(mixin, "exit_on_bad_settings", lambda **_kwargs: None)
    monkeypatch.setattr(mixin, "load_settings", lambda *_a: (CheckpointSettings(enabled=enabled), None))
    monkeypatch.setattr(spans, "register_span_group", lambda: order.append("register checkpoint") or True)
    Server.run_webserver()
    expected = ["register checkpoint"] if enabled else []
    assert order == [*expected, "gym run_webserver (init_telemetry)"]
