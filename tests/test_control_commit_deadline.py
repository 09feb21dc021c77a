"""A commit that replies ``deadline_exceeded`` publishes nothing after its reply; a retry writes the kept export."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from control_support import Gate, Harness, close_harness, make_harness, wait_until

from nemo_gym_checkpoint_plugin._storage import LocalStorage

PARTICIPANT_DIR = Path("gym") / "environment" / "env_one"


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await make_harness(tmp_path)
    harness.participant.add("r1", "r2")
    yield harness
    await close_harness(harness)


def _body(h: Harness, seconds: float) -> dict[str, Any]:
    return {
        "checkpoint_id": "c1",
        "checkpoint_dir": str(h.directory),
        "episode_ids": None,
        "deadline_ts": time.time() + seconds,
    }


def _held_writer(h: Harness) -> tuple[asyncio.Event, threading.Event, threading.Event]:
    """Hold the writer thread after the first record: (first written, release, the writer thread is done)."""
    loop = asyncio.get_running_loop()
    first_written, release, done = asyncio.Event(), threading.Event(), threading.Event()

    def held(records: list[dict]) -> Iterator[dict]:
        try:
            yield records[0]
            loop.call_soon_threadsafe(first_written.set)
            release.wait(30)
            yield from records[1:]
        finally:
            done.set()

    h.participant.records_wrapper = held
    return first_written, release, done


def _published(h: Harness) -> bool:
    return (h.directory / PARTICIPANT_DIR / "manifest.json").exists()


def _records(h: Harness) -> list[dict[str, Any]]:
    (records,) = (h.directory / PARTICIPANT_DIR).glob("records-*.jsonl")
    return [orjson.loads(line) for line in records.read_bytes().splitlines()]


async def test_a_commit_past_its_deadline_stops_its_write_and_a_retry_writes_the_kept_export(h: Harness) -> None:
    first_written, release, done = _held_writer(h)
    await h.call("prepare", checkpoint_id="c1")
    late = asyncio.create_task(h.post("commit", _body(h, 0.5)))
    await asyncio.wait_for(first_written.wait(), 10)
    reply = await late
    assert reply.status_code == 409 and reply.json()["error"]["code"] == "deadline_exceeded", reply.text
    assert "nothing is published after this reply" in reply.json()["error"]["detail"]
    release.set()  # the writer thread goes on: it must quit without publishing
    commit = h.plane.state.active.commit
    assert commit is not None
    await wait_until(commit.task.done, 10, "the stopped write to end")
    assert not done.is_set()  # it quit before the next record: the rest of the export is kept for a retry
    assert not _published(h) and list((h.directory / PARTICIPANT_DIR).glob("records-*")) == []
    # The participant changes meanwhile; the retry stores the cut the checkpoint exported.
    h.participant.episodes["r1"]["step"] = 99
    h.participant.records_wrapper = None
    committed = await h.call("commit", **_body(h, 10))
    assert committed["phase"] == "committed" and committed["episode_ids"] == ["r1", "r2"]
    assert [r["step"] for r in _records(h)] == [1, 1]
    assert len(h.participant.called("export")) == 1  # never exported twice
    # And a retry of the committed id is the same reply (idempotent).
    assert await h.call("commit", **_body(h, 10)) == committed


async def test_a_retry_while_the_stopped_write_still_runs_waits_for_it_then_writes(h: Harness) -> None:
    first_written, release, done = _held_writer(h)
    await h.call("prepare", checkpoint_id="c1")
    late = asyncio.create_task(h.post("commit", _body(h, 0.5)))
    await asyncio.wait_for(first_written.wait(), 10)
    assert (await late).json()["error"]["code"] == "deadline_exceeded"
    stopped = h.plane.state.active.writer
    retry = asyncio.create_task(h.call("commit", **_body(h, 20)))
    await asyncio.sleep(0)
    assert not retry.done() and not _published(h)
    release.set()
    committed = await retry
    assert committed["phase"] == "committed" and _published(h) and done.is_set()
    # Published by a write of its own, once the stopped one ended: never by the write the deadline stopped.
    assert stopped.stopped and h.plane.state.active.writer is not stopped
    assert [r["episode_id"]["rollout_id"] for r in _records(h)] == ["r1", "r2"]


async def test_a_deadline_reached_while_it_still_exports_stops_the_write_before_it_starts(h: Harness) -> None:
    h.participant.export_gate = gate = Gate()
    await h.call("prepare", checkpoint_id="c1")
    late = asyncio.create_task(h.post("commit", _body(h, 0.5)))
    await asyncio.wait_for(gate.entered.wait(), 10)
    assert (await late).json()["error"]["code"] == "deadline_exceeded"
    gate.release()
    commit = h.plane.state.active.commit  # the one task exporting and writing
    assert commit is not None
    await wait_until(commit.task.done, 10, "the export and its (stopped) write to end")
    assert not _published(h)
    committed = await h.call("commit", **_body(h, 10))
    assert committed["phase"] == "committed" and _published(h)
    assert len(h.participant.called("export")) == 1


async def test_a_retry_while_the_export_still_runs_lets_that_write_publish(h: Harness) -> None:
    h.participant.export_gate = gate = Gate()
    await h.call("prepare", checkpoint_id="c1")
    late = asyncio.create_task(h.post("commit", _body(h, 0.5)))
    await asyncio.wait_for(gate.entered.wait(), 10)
    assert (await late).json()["error"]["code"] == "deadline_exceeded"
    retry = asyncio.create_task(h.call("commit", **_body(h, 10)))
    await wait_until(lambda: not h.plane.state.active.writes_stopped, 10, "the retry to let the write go on")
    gate.release()
    assert (await retry)["phase"] == "committed" and _published(h)


class _CountingStorage(LocalStorage):
    """The local backend, counting the writers opened (one per write the plane starts)."""

    def __init__(self) -> None:
        self.opened = 0

    def open_writer(self, checkpoint_dir: Any, kind: str, instance: str, checkpoint_id: str) -> Any:
        self.opened += 1
        return super().open_writer(checkpoint_dir, kind, instance, checkpoint_id)


async def test_retries_past_their_deadline_while_the_stopped_write_runs_start_no_write_and_publish_nothing(
    tmp_path: Path,
) -> None:
    # Issue 30: a retry that awaits the running (stopped) write and reaches its own deadline meanwhile
    # replies deadline_exceeded: nothing may appear after that reply, and no second write runs beside
    # the first. The next retry writes the kept export once.
    storage = _CountingStorage()
    h = await make_harness(tmp_path, storage=storage)
    try:
        h.participant.add("r1", "r2")
        first_written, release, done = _held_writer(h)
        await h.call("prepare", checkpoint_id="c1")
        late = asyncio.create_task(h.post("commit", _body(h, 0.5)))
        await asyncio.wait_for(first_written.wait(), 10)
        assert (await late).json()["error"]["code"] == "deadline_exceeded"
        for _ in range(2):  # two retries, each past its deadline while the stopped write still runs
            retry = await h.post("commit", _body(h, 0.3))
            assert retry.status_code == 409 and retry.json()["error"]["code"] == "deadline_exceeded", retry.text
        assert storage.opened == 1  # they awaited the running write instead of starting another
        release.set()
        commit = h.plane.state.active.commit
        assert commit is not None
        await wait_until(commit.task.done, 10, "the retries' wait for the stopped write to end")
        assert not _published(h), "a manifest appeared after every commit replied deadline_exceeded"
        assert storage.opened == 1
        h.participant.records_wrapper = None
        committed = await h.call("commit", **_body(h, 10))
        assert committed["phase"] == "committed" and committed["episode_ids"] == ["r1", "r2"] and _published(h)
        assert storage.opened == 2 and len(h.participant.called("export")) == 1
    finally:
        await close_harness(h)


async def test_an_export_that_outlived_two_late_commits_is_awaited_and_never_repeated(tmp_path: Path) -> None:
    storage = _CountingStorage()
    h = await make_harness(tmp_path, storage=storage)
    try:
        h.participant.add("r1", "r2")
        h.participant.export_gate = gate = Gate()
        await h.call("prepare", checkpoint_id="c1")
        for _ in range(2):  # the first commit and a retry both reach their deadlines inside the export
            late = asyncio.create_task(h.post("commit", _body(h, 0.3)))
            await asyncio.wait_for(gate.entered.wait(), 10)
            assert (await late).json()["error"]["code"] == "deadline_exceeded"
        assert storage.opened == 0 and len(h.participant.called("export")) == 1
        retry = asyncio.create_task(h.call("commit", **_body(h, 10)))
        await wait_until(lambda: not h.plane.state.active.writes_stopped, 10, "the retry to let the write go on")
        gate.release()
        committed = await retry
        assert committed["phase"] == "committed" and committed["episode_ids"] == ["r1", "r2"] and _published(h)
        assert len(h.participant.called("export")) == 1 and storage.opened == 1  # awaited, never repeated
    finally:
        await close_harness(h)
