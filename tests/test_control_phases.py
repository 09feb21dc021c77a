"""Phases, fencing and replay of the control plane, driven over HTTP in-process."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from control_support import Gate, Harness, close_harness, deadline, make_harness, wait_until, wire

from nemo_gym_checkpoint_plugin._control import RESUMED_MEMORY


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await make_harness(tmp_path)
    yield harness
    await close_harness(harness)


async def test_hook_open_admission_prepare_closes_and_resume_reopens(h: Harness) -> None:
    reply = await h.call("prepare", checkpoint_id="c1")
    assert reply["phase"] == "prepared" and reply["report"]["ready"] is True
    assert not h.plane.admission.is_open
    assert h.participant.called("close_admission") == [{"checkpoint_id": "c1"}]
    assert (await h.status())["phase"] == "prepared"
    assert await h.call("resume", checkpoint_id="c1") == {"phase": "idle", "idempotent": False}
    assert h.plane.admission.is_open
    assert h.participant.called("open_admission") == [{"checkpoint_id": "c1"}]


async def test_hook_ready_and_wait_ready_prepare_waits_outside_the_lock(h: Harness) -> None:
    h.participant.blockers = {"r1", "r2-a1"}
    prepare = asyncio.create_task(h.call("prepare", checkpoint_id="c1"))
    await wait_until(lambda: h.plane.phase == "preparing", what="preparing")
    # The transition lock is free while prepare waits: status and renew answer.
    assert (await h.status())["report"]["blockers"] == ["r1", "r2-a1"]
    assert "lease_expires_at" in await h.call("renew", checkpoint_id="c1")
    h.participant.unblock("r1")
    h.participant.unblock("r2-a1")
    reply = await prepare
    assert reply["phase"] == "prepared" and reply["report"]["blockers"] == []
    assert "ready" in h.recorder.names and "wait_ready" in h.recorder.names


async def test_resume_arrives_while_prepare_waits(h: Harness) -> None:
    h.participant.blockers = {"r1"}
    prepare = asyncio.create_task(h.post("prepare", {"checkpoint_id": "c1", "deadline_ts": deadline()}))
    await wait_until(lambda: h.plane.phase == "preparing", what="preparing")
    assert (await h.call("resume", checkpoint_id="c1"))["idempotent"] is False
    response = await prepare
    assert response.status_code == 409 and response.json()["error"]["code"] == "stale_checkpoint"
    assert h.plane.admission.is_open and h.plane.phase == "idle"


async def test_prepare_that_misses_its_deadline_replies_its_blockers_and_keeps_admission_closed(h: Harness) -> None:
    h.participant.blockers = {f"r{i}" for i in range(150)}
    reply = await h.call("prepare", checkpoint_id="c1", deadline_ts=time.time() + 0.4)
    assert reply["phase"] == "preparing"
    report = reply["report"]
    assert report["ready"] is False and report["blocker_count"] == 150 and len(report["blockers"]) == 100
    assert not h.plane.admission.is_open
    # A retry with a new deadline joins the same wait and sees it finish.
    retry = asyncio.create_task(h.call("prepare", checkpoint_id="c1"))
    h.participant.blockers.clear()
    h.participant.changed.set()
    assert (await retry)["phase"] == "prepared"


async def test_restarts_are_reported_and_never_block(h: Harness) -> None:
    h.participant.restarts = {"r9", "r8-a2"}
    reply = await h.call("prepare", checkpoint_id="c1")
    assert reply["report"]["ready"] is True and reply["report"]["restarts"] == ["r8-a2", "r9"]


async def test_prepare_that_raises_reopens_admission(h: Harness) -> None:
    h.participant.blockers = {"r1"}
    h.participant.ready_error = None
    prepare = asyncio.create_task(h.post("prepare", {"checkpoint_id": "c1", "deadline_ts": deadline()}))
    await wait_until(lambda: h.plane.phase == "preparing", what="preparing")
    h.participant.ready_error = RuntimeError("participant broke")
    h.participant.changed.set()
    with pytest.raises(RuntimeError, match="participant broke"):
        await prepare
    assert h.plane.phase == "idle" and h.plane.admission.is_open
    assert h.participant.called("open_admission") == [{"checkpoint_id": "c1"}]


async def test_hook_close_admission_raising_reopens_admission(h: Harness) -> None:
    from nemo_gym_checkpoint_plugin._errors import InvalidPhase

    h.participant.close_error = InvalidPhase("cannot close")
    await h.error("prepare", "invalid_phase", checkpoint_id="c1")
    assert h.plane.phase == "idle" and h.plane.admission.is_open and h.plane.checkpoint_id is None
    assert "close_admission" in h.recorder.names and "open_admission" in h.recorder.names


async def test_deadline_passed_on_arrival_changes_nothing(h: Harness) -> None:
    await h.error("prepare", "deadline_exceeded", checkpoint_id="c1", deadline_ts=time.time() - 1)
    assert h.plane.phase == "idle" and h.plane.admission.is_open and h.participant.calls == []


async def test_fencing_conflict_and_stale(h: Harness) -> None:
    await h.call("prepare", checkpoint_id="c1")
    await h.error("prepare", "checkpoint_conflict", checkpoint_id="c2")
    await h.error(
        "commit", "checkpoint_conflict", checkpoint_id="c2", checkpoint_dir=str(h.directory), episode_ids=None
    )
    await h.error("resume", "checkpoint_conflict", checkpoint_id="c2")
    await h.call("resume", checkpoint_id="c1")
    for route in ("prepare", "renew"):
        await h.error(route, "stale_checkpoint", checkpoint_id="c1")
    await h.error("commit", "stale_checkpoint", checkpoint_id="c1", checkpoint_dir=str(h.directory), episode_ids=None)
    assert await h.call("resume", checkpoint_id="c1") == {"phase": "idle", "idempotent": True}


async def test_resume_while_idle_is_idempotent_and_remembered(h: Harness) -> None:
    assert await h.call("resume", checkpoint_id="never-prepared") == {"phase": "idle", "idempotent": True}
    await h.error("prepare", "stale_checkpoint", checkpoint_id="never-prepared")


async def test_the_last_64_resumed_ids_are_remembered(h: Harness) -> None:
    for n in range(RESUMED_MEMORY + 1):
        await h.call("resume", checkpoint_id=f"old-{n}")
    await h.error("prepare", "stale_checkpoint", checkpoint_id=f"old-{RESUMED_MEMORY}")
    await h.error("prepare", "stale_checkpoint", checkpoint_id="old-1")
    # old-0 fell out of the memory: it may be prepared again.
    assert (await h.call("prepare", checkpoint_id="old-0"))["phase"] == "prepared"


async def test_commit_only_when_prepared(h: Harness) -> None:
    await h.error("commit", "invalid_phase", checkpoint_id="c1", checkpoint_dir=str(h.directory), episode_ids=None)
    h.participant.blockers = {"r1"}
    await h.call("prepare", checkpoint_id="c1", deadline_ts=time.time() + 0.3)
    await h.error("commit", "invalid_phase", checkpoint_id="c1", checkpoint_dir=str(h.directory), episode_ids=None)
    assert h.participant.called("export") == []


async def test_hook_export_commit_writes_the_scope_and_replays(h: Harness) -> None:
    h.participant.add("r1", "r2-a1", "r3")
    reply = await h.checkpoint("c1", ["r2-a1", "r1", "unseen"])
    assert reply["phase"] == "committed" and reply["episode_ids"] == ["r1", "r2-a1"]
    assert reply["exported_count"] == 2  # a participant extra; protocol fields are not replaced
    manifest = reply["manifest"]
    assert manifest["checkpoint_id"] == "c1" and manifest["record_count"] == 2
    assert manifest["participant_note"] == "in-test"
    assert (h.directory / "gym" / "environment" / "env_one" / "manifest.json").exists()
    assert h.plane.phase == "committed"
    # Same arguments (scope in another order): the same reply, no second export.
    again = await h.call(
        "commit",
        checkpoint_id="c1",
        checkpoint_dir=str(h.directory) + "/",
        episode_ids=[wire("unseen"), wire("r1"), wire("r2-a1")],
    )
    assert again == reply
    assert len(h.participant.called("export")) == 1
    # Different directory or scope: conflict.
    await h.error(
        "commit",
        "checkpoint_conflict",
        checkpoint_id="c1",
        checkpoint_dir=str(h.directory / "x"),
        episode_ids=[wire("r1"), wire("r2-a1"), wire("unseen")],
    )
    await h.error(
        "commit", "checkpoint_conflict", checkpoint_id="c1", checkpoint_dir=str(h.directory), episode_ids=[wire("r1")]
    )
    # A completed prepare is replayed too, even after the commit.
    assert (await h.call("prepare", checkpoint_id="c1"))["phase"] == "prepared"


async def test_commit_never_writes_records_outside_the_scope(h: Harness) -> None:
    h.participant.add("r1", "r2")
    h.participant.records_outside_scope = True
    reply = await h.checkpoint("c1", ["r1"])
    assert reply["episode_ids"] == ["r1"] and reply["manifest"]["record_count"] == 1


async def test_null_scope_exports_everything_it_holds(h: Harness) -> None:
    h.participant.add("r1", "r2")
    reply = await h.checkpoint("c1", None)
    assert reply["episode_ids"] == ["r1", "r2"]
    assert h.participant.called("export")[0]["scope"] is None


async def test_commit_refuses_a_scope_naming_a_restart(h: Harness) -> None:
    h.participant.add("r1")
    h.participant.restarts = {"r9"}
    await h.call("prepare", checkpoint_id="c1")
    error = await h.error(
        "commit",
        "restart_in_scope",
        checkpoint_id="c1",
        checkpoint_dir=str(h.directory),
        episode_ids=[wire("r1"), wire("r9")],
    )
    assert "r9" in error["detail"]
    assert h.participant.called("export") == []
    # The refusal consumed nothing: a scope without the restart commits.
    assert (await h.call("commit", checkpoint_id="c1", checkpoint_dir=str(h.directory), episode_ids=[wire("r1")]))[
        "episode_ids"
    ] == ["r1"]


async def test_readiness_that_regressed_after_prepare_ends_the_checkpoint_for_good(h: Harness) -> None:
    h.participant.add("r1")
    await h.call("prepare", checkpoint_id="c1")
    h.participant.blockers = {"r5"}
    body = {"checkpoint_id": "c1", "checkpoint_dir": str(h.directory), "episode_ids": None}
    error = await h.error("commit", "export_failed", **body)
    assert "regressed" in error["detail"] and "r5" in error["detail"]
    # Readiness recovers: a retry must not commit a later cut than the other participants did.
    h.participant.blockers.clear()
    await h.error("commit", "export_failed", **body)
    # Every later commit of the id, whatever its arguments (not checkpoint_conflict).
    await h.error("commit", "export_failed", **{**body, "checkpoint_dir": str(h.directory / "other")})
    await h.error("commit", "export_failed", **{**body, "episode_ids": [wire("r1")], "stop": True})
    assert h.participant.called("export") == []
    assert not (h.directory / "gym").exists()
    assert h.plane.phase == "prepared" and not h.plane.admission.is_open
    # The controller resumes and prepares again under a new id, which commits.
    await h.call("resume", checkpoint_id="c1")
    assert (await h.checkpoint("c2", None))["episode_ids"] == ["r1"]


async def test_a_failed_export_ends_the_checkpoint_for_good(h: Harness) -> None:
    h.participant.export_error = RuntimeError("disk of the sandbox vanished")
    await h.call("prepare", checkpoint_id="c1")
    body = {"checkpoint_id": "c1", "checkpoint_dir": str(h.directory), "episode_ids": None}
    first = await h.error("commit", "export_failed", **body)
    assert "disk of the sandbox vanished" in first["detail"]
    h.participant.export_error = None
    await h.error("commit", "export_failed", **body)
    # Every later commit of the id, even with other arguments (not checkpoint_conflict).
    await h.error("commit", "export_failed", **{**body, "checkpoint_dir": str(h.directory / "elsewhere")})
    await h.error("commit", "export_failed", **{**body, "episode_ids": []})
    assert len(h.participant.called("export")) == 1
    assert not (h.directory / "gym" / "environment" / "env_one" / "manifest.json").exists()


async def test_a_directory_that_cannot_hold_state_is_invalid_checkpoint_state(h: Harness, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    await h.call("prepare", checkpoint_id="c1")
    body = {"checkpoint_id": "c1", "checkpoint_dir": str(blocker / "under"), "episode_ids": None}
    error = await h.error("commit", "invalid_checkpoint_state", **body)
    assert str(blocker) in error["detail"]
    assert blocker.read_text() == "not a directory"


async def test_hook_restored_pending_and_delete_restored_after_the_write(h: Harness) -> None:
    h.participant.add("r1-a1", "r2-a1", "r3")
    h.participant.pending = {"r1-a1", "r2-a1"}
    await h.checkpoint("c1", ["r1-a1", "r3"])
    assert h.participant.called("delete_restored") == [{"episode_ids": ["r2-a1"]}]
    assert "r2-a1" not in h.participant.episodes and "r1-a1" in h.participant.episodes
    assert "restored_pending" in h.recorder.names


async def test_hook_release_exported_on_stop_and_its_failure_is_only_logged(h: Harness) -> None:
    h.participant.add("r1")
    h.participant.release_error = RuntimeError("sandbox already gone")
    reply = await h.checkpoint("c1", ["r1"], stop=True)
    assert reply["phase"] == "committed"
    assert h.participant.called("release_exported") == [{"checkpoint_id": "c1", "episode_keys": ["r1"]}]


async def test_no_release_without_stop(h: Harness) -> None:
    h.participant.add("r1")
    await h.checkpoint("c1", ["r1"])
    assert h.participant.called("release_exported") == []


async def test_resume_cancels_a_running_export_and_no_manifest_appears(h: Harness) -> None:
    h.participant.add("r1")
    h.participant.export_gate = gate = Gate()
    await h.call("prepare", checkpoint_id="c1")
    commit = asyncio.create_task(
        h.post(
            "commit",
            {"checkpoint_id": "c1", "checkpoint_dir": str(h.directory), "episode_ids": None, "deadline_ts": deadline()},
        )
    )
    await asyncio.wait_for(gate.entered.wait(), 5)
    assert (await h.call("resume", checkpoint_id="c1"))["idempotent"] is False
    assert (await commit).json()["error"]["code"] == "stale_checkpoint"
    gate.release()
    assert h.plane.admission.is_open
    assert not (h.directory / "gym").exists()


async def test_resume_stops_the_writer_before_it_publishes(h: Harness) -> None:
    loop = asyncio.get_running_loop()
    first_written = asyncio.Event()
    release = threading.Event()

    def held(records: list[dict]) -> Iterator[dict]:
        # Runs in the writer's thread: hold it between two records until resume returned.
        yield records[0]
        loop.call_soon_threadsafe(first_written.set)
        release.wait(10)
        yield from records[1:]

    h.participant.add("r1", "r2")
    h.participant.records_wrapper = held
    await h.call("prepare", checkpoint_id="c1")
    commit = asyncio.create_task(
        h.post(
            "commit",
            {"checkpoint_id": "c1", "checkpoint_dir": str(h.directory), "episode_ids": None, "deadline_ts": deadline()},
        )
    )
    await asyncio.wait_for(first_written.wait(), 5)
    await h.call("resume", checkpoint_id="c1")
    release.set()
    assert (await commit).json()["error"]["code"] == "stale_checkpoint"
    participant_dir = h.directory / "gym" / "environment" / "env_one"
    await wait_until(lambda: not list(participant_dir.glob(".records.*.tmp")), what="the writer thread to quit")
    assert not (participant_dir / "manifest.json").exists()
    assert list(participant_dir.glob("records-*.jsonl")) == []


async def test_resume_waits_for_restored_state_cleanup_and_may_run_out_of_time(h: Harness) -> None:
    h.participant.add("r1-a1", "r2-a1")
    h.participant.pending = {"r1-a1", "r2-a1"}
    h.participant.delete_gate = gate = Gate()
    await h.call("prepare", checkpoint_id="c1")
    reply = await h.call(
        "commit",
        checkpoint_id="c1",
        checkpoint_dir=str(h.directory),
        episode_ids=[wire("r1-a1")],
        deadline_ts=time.time() + 0.3,
    )
    assert reply["phase"] == "committed"  # the write is durable; cleanup outlived the deadline
    assert gate.entered.is_set()
    await h.error("resume", "deadline_exceeded", checkpoint_id="c1", deadline_ts=time.time() + 0.3)
    assert h.plane.phase == "committed" and not h.plane.admission.is_open
    resume = asyncio.create_task(h.call("resume", checkpoint_id="c1"))
    gate.release()
    assert (await resume)["idempotent"] is False
    assert "r2-a1" not in h.participant.episodes and h.plane.admission.is_open
