"""Failures the control plane must survive the way docs/protocol.md "Errors" and "Phases" say.

A failed write keeps its export (a retry, into the same or another directory, stores the same
records); a failed export or a readiness regression ends the checkpoint; a reopening of
admission that failed during a restore's rollback stays pending until a resume retries it;
deadlines further ahead than the documented bound are refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from control_support import FailingStorage, close_harness, deadline, make_harness, wait_until, wire

from nemo_gym_checkpoint_plugin._control import MAX_DEADLINE_AHEAD_SECONDS
from nemo_gym_checkpoint_plugin._identity import EpisodeId

PARTICIPANT_DIR = Path("gym") / "environment" / "env_one"


def stored(directory: Path) -> list[dict[str, Any]]:
    (records,) = (directory / PARTICIPANT_DIR).glob("records-*.jsonl")
    return [orjson.loads(line) for line in records.read_bytes().splitlines()]


def commit_body(directory: Path, scope: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "checkpoint_id": "c1",
        "checkpoint_dir": str(directory),
        "episode_ids": None if scope is None else [wire(k) for k in scope],
        **extra,
    }


async def test_a_failed_write_keeps_its_export_for_a_retry_into_another_directory(tmp_path: Path) -> None:
    storage = FailingStorage(fail_writes=1)
    h = await make_harness(tmp_path, storage=storage)
    try:
        h.participant.add("r1", "r2-a1")

        def live(records: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
            # Reads the participant's state as the writer consumes it: only a kept export stays the same cut.
            for record in records:
                yield dict(h.participant.episodes[EpisodeId.model_validate(record["episode_id"]).capture_key])

        h.participant.records_wrapper = live
        await h.call("prepare", checkpoint_id="c1")
        first, second = tmp_path / "full", tmp_path / "roomy"
        error = await h.error("commit", "invalid_checkpoint_state", **commit_body(first))
        assert "no space left on device" in error["detail"]
        assert h.plane.phase == "prepared" and not (first / PARTICIPANT_DIR / "manifest.json").exists()
        (exported,) = storage.consumed
        assert [r["episode_id"] for r in exported] == [wire("r1"), wire("r2-a1")]
        # The participant changes meanwhile; the retry must store the cut exported before.
        h.participant.episodes["r1"]["step"] = 99
        h.participant.add("r3")
        reply = await h.call("commit", **commit_body(second))
        assert reply["phase"] == "committed" and reply["episode_ids"] == ["r1", "r2-a1"]
        assert stored(second) == exported
        assert len(h.participant.called("export")) == 1
        assert h.plane.phase == "committed"
        # After a successful write the usual replay rules hold again.
        assert await h.call("commit", **commit_body(second)) == reply
        await h.error("commit", "checkpoint_conflict", **commit_body(first))
    finally:
        await close_harness(h)


async def test_a_write_that_fails_again_is_retried_with_the_same_scope_and_stop_only(tmp_path: Path) -> None:
    storage = FailingStorage(fail_writes=2)
    h = await make_harness(tmp_path, storage=storage)
    try:
        h.participant.add("r1", "r2")
        await h.call("prepare", checkpoint_id="c1")
        target = tmp_path / "ckpt"
        await h.error("commit", "invalid_checkpoint_state", **commit_body(target, ["r1", "r2"]))
        await h.error("commit", "invalid_checkpoint_state", **commit_body(target, ["r2", "r1"]))
        assert storage.consumed[0] == storage.consumed[1] and len(storage.consumed[0]) == 2
        # Only the directory may differ after a failed write: another scope or stop is another commit.
        await h.error("commit", "checkpoint_conflict", **commit_body(target, ["r1"]))
        await h.error("commit", "checkpoint_conflict", **commit_body(target, ["r1", "r2"], stop=True))
        await h.error("commit", "checkpoint_conflict", **commit_body(target, None))
        reply = await h.call("commit", **commit_body(target, ["r1", "r2"]))
        assert reply["episode_ids"] == ["r1", "r2"] and stored(target) == storage.consumed[0]
        assert len(h.participant.called("export")) == 1
    finally:
        await close_harness(h)


async def test_a_resume_ends_a_kept_export(tmp_path: Path) -> None:
    h = await make_harness(tmp_path, storage=FailingStorage(fail_writes=1))
    try:
        h.participant.add("r1")
        await h.call("prepare", checkpoint_id="c1")
        await h.error("commit", "invalid_checkpoint_state", **commit_body(tmp_path / "a"))
        await h.call("resume", checkpoint_id="c1")
        assert h.plane.admission.is_open
        await h.error("commit", "stale_checkpoint", **commit_body(tmp_path / "b"))
        assert not (tmp_path / "b").exists()
    finally:
        await close_harness(h)


async def test_a_record_that_is_not_json_ends_the_checkpoint(tmp_path: Path) -> None:
    h = await make_harness(tmp_path)
    try:
        h.participant.add("r1")
        h.participant.episodes["r1"]["bad"] = {1, 2}  # a set: the writer refuses it (not a write failure)
        await h.call("prepare", checkpoint_id="c1")
        error = await h.error("commit", "invalid_checkpoint_state", **commit_body(tmp_path / "a"))
        assert "not JSON" in error["detail"]
        del h.participant.episodes["r1"]["bad"]
        await h.error("commit", "export_failed", **commit_body(tmp_path / "a"))
        await h.error("commit", "export_failed", **commit_body(tmp_path / "b"))
        assert len(h.participant.called("export")) == 1
    finally:
        await close_harness(h)


async def test_an_iterator_that_raises_inside_the_write_ends_the_checkpoint(tmp_path: Path) -> None:
    h = await make_harness(tmp_path)
    try:
        h.participant.add("r1", "r2")

        def broken(records: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
            yield records[0]
            raise RuntimeError("the sandbox went away mid-export")

        h.participant.records_wrapper = broken
        await h.call("prepare", checkpoint_id="c1")
        error = await h.error("commit", "export_failed", **commit_body(tmp_path / "a"))
        assert "the sandbox went away" in error["detail"]
        h.participant.records_wrapper = None
        await h.error("commit", "export_failed", **commit_body(tmp_path / "b"))
    finally:
        await close_harness(h)


# -- reopening admission after a failed restore ------------------------------------------------------


async def test_a_reopening_that_failed_in_a_restores_rollback_is_retried_by_the_next_resume(tmp_path: Path) -> None:
    h = await make_harness(tmp_path)
    try:
        h.participant.open_error = RuntimeError("the model server did not release its held replies")
        await h.error(
            "restore",
            "invalid_checkpoint_state",
            checkpoint_id="restore-1",
            checkpoint_dir=str(tmp_path / "never-committed"),
            episode_ids=[wire("r1")],
        )
        assert h.plane.phase == "idle" and h.plane.admission.is_open
        assert len(h.participant.called("open_admission")) == 1
        # The controller resumes everyone after a failed restore: not a no-op while reopening is pending.
        error = await h.error("resume", "invalid_phase", checkpoint_id="restore-1")
        assert "did not release its held replies" in error["detail"] and "resume again" in error["detail"]
        assert len(h.participant.called("open_admission")) == 2
        h.participant.open_error = None
        assert await h.call("resume", checkpoint_id="restore-1") == {"phase": "idle", "idempotent": False}
        assert len(h.participant.called("open_admission")) == 3
        # Done: the next resume is a no-op again, and the id stays remembered.
        assert await h.call("resume", checkpoint_id="restore-1") == {"phase": "idle", "idempotent": True}
        await h.error("prepare", "stale_checkpoint", checkpoint_id="restore-1")
        assert len(h.participant.called("open_admission")) == 3
    finally:
        await close_harness(h)


async def test_a_resume_whose_own_reopening_fails_reports_it(tmp_path: Path) -> None:
    h = await make_harness(tmp_path)
    try:
        await h.call("prepare", checkpoint_id="c1")
        h.participant.open_error = RuntimeError("hook broke")
        await h.error("resume", "invalid_phase", checkpoint_id="c1")
        assert h.plane.phase == "idle" and h.plane.admission.is_open
        h.participant.open_error = None
        assert await h.call("resume", checkpoint_id="other") == {"phase": "idle", "idempotent": False}
        assert await h.call("resume", checkpoint_id="c1") == {"phase": "idle", "idempotent": True}
    finally:
        await close_harness(h)


# -- deadlines ---------------------------------------------------------------------------------------

BODIES: dict[str, dict[str, Any]] = {
    "prepare": {"checkpoint_id": "c1"},
    "renew": {"checkpoint_id": "c1"},
    "resume": {"checkpoint_id": "c1"},
    "commit": {"checkpoint_id": "c1", "checkpoint_dir": "/tmp/x", "episode_ids": None},
    "restore": {"checkpoint_id": "c1", "checkpoint_dir": "/tmp/x", "episode_ids": [wire("r1")]},
    "retire": {"checkpoint_id": "c1", "episode_ids": [wire("r1")]},
    "forget": {"checkpoint_id": "c1", "rollout_ids": ["r1"]},
}


@pytest.mark.parametrize("route", sorted(BODIES))
async def test_a_deadline_in_milliseconds_is_refused_on_every_route(tmp_path: Path, route: str) -> None:
    h = await make_harness(tmp_path)
    try:
        response = await h.post(route, {**BODIES[route], "deadline_ts": time.time() * 1000})
        assert response.status_code == 422, response.text
        (error,) = response.json()["detail"]
        assert error["type"] == "deadline_too_far" and error["loc"] == ["body", "deadline_ts"]
        assert "24 hours" in error["msg"]
        assert h.plane.phase == "idle" and h.participant.calls == [] and len(h.plane.marks) == 0
        assert h.plane.lease.expires_at is None
    finally:
        await close_harness(h)


async def test_the_deadline_bound_is_measured_on_the_planes_clock(tmp_path: Path) -> None:
    now = time.time() + 30 * 86400  # the plane's clock, far from the wall clock
    h = await make_harness(tmp_path, clock=lambda: now)
    try:
        reply = await h.call("prepare", checkpoint_id="c1", deadline_ts=now + MAX_DEADLINE_AHEAD_SECONDS)
        assert reply["phase"] == "prepared"
        too_far = now + MAX_DEADLINE_AHEAD_SECONDS + 1
        response = await h.post("renew", {"checkpoint_id": "c1", "deadline_ts": too_far})
        assert response.status_code == 422 and response.json()["detail"][0]["type"] == "deadline_too_far"
        assert MAX_DEADLINE_AHEAD_SECONDS == 24 * 3600
    finally:
        await close_harness(h)


async def test_an_ordinary_deadline_is_accepted(tmp_path: Path) -> None:
    h = await make_harness(tmp_path)
    try:
        assert (await h.call("prepare", checkpoint_id="c1", deadline_ts=deadline(3600)))["phase"] == "prepared"
    finally:
        await close_harness(h)


async def test_a_restore_whose_close_of_admission_fails_part_way_reopens_admission(tmp_path: Path) -> None:
    # Issue 30: tested for prepare only before. The second participant closes admission first (pluggy calls
    # the last registered first), then the first one's close raises: the one that closed is reopened too.
    from nemo_gym_checkpoint_plugin._errors import InvalidPhase
    from nemo_gym_checkpoint_plugin._markers import hookimpl

    class Admission:
        """A second participant with nothing to export: it only closes and reopens its admission."""

        def __init__(self) -> None:
            self.calls: list[tuple[str, str]] = []

        def called(self, name: str) -> list[dict[str, str]]:
            return [{"checkpoint_id": c} for hook, c in self.calls if hook == name]

        @hookimpl
        def close_admission(self, checkpoint_id: str) -> None:
            self.calls.append(("close_admission", checkpoint_id))

        @hookimpl
        def open_admission(self, checkpoint_id: str) -> None:
            self.calls.append(("open_admission", checkpoint_id))

    closed_first = Admission()
    h = await make_harness(tmp_path, extra_plugins=(closed_first,))
    try:
        h.participant.add("r1")
        await h.checkpoint("c1", None)
        await h.call("resume", checkpoint_id="c1")
        opened_before = len(closed_first.called("open_admission"))
        h.participant.close_error = InvalidPhase("the environment cannot close its admission")
        restore = {"checkpoint_id": "restore-1", "checkpoint_dir": str(h.directory), "episode_ids": [wire("r1")]}
        error = await h.error("restore", "invalid_phase", **restore)
        assert "cannot close its admission" in error["detail"]
        assert closed_first.called("close_admission")[-1] == {"checkpoint_id": "restore-1"}  # part way
        assert h.plane.phase == "idle" and h.plane.checkpoint_id is None and h.plane.admission.is_open
        assert len(closed_first.called("open_admission")) == opened_before + 1
        assert len(h.participant.called("open_admission")) == opened_before + 1
        assert h.participant.called("install") == [] and h.participant.pending == set()
        # The marks stay: the checkpointed attempt is refused whatever happens next.
        assert h.plane.marks.is_retired("r1", 0)
        # The same restore once admission closes: it installs the replacement.
        h.participant.close_error = None
        reply = await h.call("restore", **restore)
        assert reply["phase"] == "restored" and reply["restored"] == ["r1-a1"]
        assert not h.plane.admission.is_open
    finally:
        await close_harness(h)


async def test_a_failed_delete_of_unscoped_restored_state_is_done_again_by_the_retried_commit(tmp_path: Path) -> None:
    # Issue 30: the commit only logs a failed delete_restored (the write is durable, the reply committed);
    # the controller's retry of the same commit must delete again, and reply the same manifest.
    h = await make_harness(tmp_path)
    try:
        h.participant.add("r1", "r3-a1")
        h.participant.pending = {"r3-a1"}  # restored, not started: the scope below leaves it out
        h.participant.delete_error = RuntimeError("the capture directory is not writable")
        await h.call("prepare", checkpoint_id="c1")
        body = commit_body(h.directory, ["r1"])
        committed = await h.call("commit", **body)
        assert committed["phase"] == "committed" and committed["episode_ids"] == ["r1"]
        cleanup = h.plane.state.active.cleanup_task
        assert cleanup is not None
        await wait_until(cleanup.done, 10, "the failed delete to end")
        assert h.participant.pending == {"r3-a1"} and len(h.participant.called("delete_restored")) == 1
        h.participant.delete_error = None
        assert await h.call("commit", **body) == committed  # the same manifest
        assert h.participant.called("delete_restored") == [{"episode_ids": ["r3-a1"]}] * 2
        assert h.participant.pending == set() and "r3-a1" not in h.participant.episodes
        # Done once it succeeded: a third retry deletes nothing again.
        assert await h.call("commit", **body) == committed
        assert len(h.participant.called("delete_restored")) == 2
    finally:
        await close_harness(h)
