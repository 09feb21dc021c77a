"""Restore, retire, forget and the retired marks, driven over HTTP in-process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from control_support import Gate, Harness, Participant, close_harness, make_harness, wait_until, wire

from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await make_harness(tmp_path)
    yield harness
    await close_harness(harness)


async def committed(h: Harness, *keys: str, checkpoint_id: str = "step-1") -> None:
    """Commit ``keys`` as checkpoint ``checkpoint_id`` and resume, leaving an idle participant."""
    h.participant.add(*keys, step=3)
    await h.checkpoint(checkpoint_id, list(keys))
    await h.call("resume", checkpoint_id=checkpoint_id)
    h.participant.episodes.clear()


async def test_hook_install_restore_marks_reads_installs_and_replies(h: Harness) -> None:
    await committed(h, "r1", "r2-a1", "r3")
    reply = await h.call(
        "restore",
        checkpoint_id="restore-1",
        checkpoint_dir=str(h.directory),
        episode_ids=[wire("r2-a1"), wire("r1"), wire("unseen")],
    )
    assert reply == {"phase": "restored", "source_checkpoint_id": "step-1", "restored": ["r1-a1", "r2-a2"]}
    # Marks up to the checkpointed attempts: the checkpointed attempts are refused, replacements are not.
    assert h.plane.marks.is_retired("r1", 0) and not h.plane.marks.is_retired("r1", 1)
    assert h.plane.marks.is_retired("r2", 1) and not h.plane.marks.is_retired("r2", 2)
    assert h.plane.marks.is_retired("unseen", 0) and not h.plane.marks.is_retired("r3", 0)
    installed = h.participant.called("install")[0]
    assert installed["checkpoint_id"] == "restore-1" and installed["manifest"]["checkpoint_id"] == "step-1"
    assert sorted(r.replacement.capture_key for r in installed["records"]) == ["r1-a1", "r2-a2"]
    assert h.participant.episodes["r1-a1"]["step"] == 3
    assert not h.plane.admission.is_open and (await h.status())["phase"] == "restored"
    assert (await h.status())["retired_rollouts"] == 3
    await h.call("resume", checkpoint_id="restore-1")
    assert h.plane.admission.is_open


async def test_restore_into_a_live_process_retires_the_checkpointed_attempts_before_installing(h: Harness) -> None:
    await committed(h, "r1", "r2")
    # This process did not crash: it still holds r1's checkpointed attempt (say, an open session).
    h.participant.add("r1", step=9)
    await h.call("restore", checkpoint_id="restore-1", checkpoint_dir=str(h.directory), episode_ids=[wire("r1")])
    hooks = [name for name, _ in h.participant.calls if name in ("retire", "install")]
    assert hooks == ["retire", "install"]
    assert h.participant.called("retire")[0]["episode_ids"] == ["r1"]
    assert "r1" not in h.participant.episodes and h.participant.episodes["r1-a1"]["step"] == 3
    await h.call("resume", checkpoint_id="restore-1")


async def test_restore_replays_and_fences(h: Harness) -> None:
    await committed(h, "r1")
    body = {"checkpoint_id": "restore-1", "checkpoint_dir": str(h.directory), "episode_ids": [wire("r1")]}
    first = await h.call("restore", **body)
    assert await h.call("restore", **body) == first
    assert len(h.participant.called("install")) == 1
    await h.error("restore", "checkpoint_conflict", **{**body, "episode_ids": []})
    await h.error("restore", "checkpoint_conflict", **{**body, "checkpoint_id": "restore-2"})
    await h.error("prepare", "checkpoint_conflict", checkpoint_id="c9")
    await h.error("prepare", "invalid_phase", checkpoint_id="restore-1")
    await h.call("resume", checkpoint_id="restore-1")
    await h.error("restore", "stale_checkpoint", **body)


async def test_a_failed_read_reopens_admission_and_keeps_the_marks(h: Harness) -> None:
    error = await h.error(
        "restore",
        "invalid_checkpoint_state",
        checkpoint_id="restore-1",
        checkpoint_dir=str(h.directory / "nothing"),
        episode_ids=[wire("r1-a2")],
    )
    assert "manifest" in error["detail"]
    assert h.plane.phase == "idle" and h.plane.admission.is_open
    assert h.plane.marks.is_retired("r1", 2)


async def test_a_failed_install_leaves_nothing_installed(h: Harness) -> None:
    await committed(h, "r1")
    h.participant.install_error = ValueError("record refers to a tool this server does not have")
    error = await h.error(
        "restore",
        "invalid_checkpoint_state",
        checkpoint_id="restore-1",
        checkpoint_dir=str(h.directory),
        episode_ids=[wire("r1")],
    )
    assert "tool" in error["detail"]
    assert h.participant.called("delete_restored") == [{"episode_ids": ["r1-a1"]}]
    assert h.participant.episodes == {} and h.plane.admission.is_open and h.plane.phase == "idle"


async def test_an_install_that_outlives_its_deadline_is_kept(h: Harness) -> None:
    await committed(h, "r1")
    h.participant.install_gate = gate = Gate()
    body = {"checkpoint_id": "restore-1", "checkpoint_dir": str(h.directory), "episode_ids": [wire("r1")]}
    await h.error("restore", "deadline_exceeded", **body, deadline_ts=time.time() + 0.4)
    assert gate.entered.is_set() and h.plane.phase == "restored"
    # Resume ends the restore, but admission stays closed until the install finished.
    await h.call("resume", checkpoint_id="restore-1")
    assert h.plane.phase == "idle" and not h.plane.admission.is_open
    gate.release()
    await wait_until(lambda: h.plane.admission.is_open, what="admission to reopen after the install")
    assert "r1-a1" in h.participant.episodes and h.participant.called("delete_restored") == []


async def test_a_late_install_completes_the_restore_for_a_retry(h: Harness) -> None:
    await committed(h, "r1")
    h.participant.install_gate = gate = Gate()
    body = {"checkpoint_id": "restore-1", "checkpoint_dir": str(h.directory), "episode_ids": [wire("r1")]}
    await h.error("restore", "deadline_exceeded", **body, deadline_ts=time.time() + 0.4)
    gate.release()
    assert (await h.call("restore", **body))["restored"] == ["r1-a1"]
    assert len(h.participant.called("install")) == 1


async def test_hook_retire_waits_for_a_running_install(h: Harness) -> None:
    await committed(h, "r1")
    h.participant.install_gate = gate = Gate()
    body = {"checkpoint_id": "restore-1", "checkpoint_dir": str(h.directory), "episode_ids": [wire("r1")]}
    await h.error("restore", "deadline_exceeded", **body, deadline_ts=time.time() + 0.4)
    retire = asyncio.create_task(h.call("retire", checkpoint_id="restore-1", episode_ids=[wire("r1-a1")]))
    # Marked at once, before the deadline-bound wait; the retire hook waits for the install.
    await wait_until(lambda: h.plane.marks.is_retired("r1", 1), what="the retire mark")
    # Only the restore's own retire of the checkpointed attempt ran, before its install.
    assert h.participant.called("retire") == [{"episode_ids": ["r1"]}]
    gate.release()
    assert (await retire) == {"retired_count": 1}
    assert h.participant.called("retire") == [{"episode_ids": ["r1"]}, {"episode_ids": ["r1-a1"]}]
    assert "r1-a1" not in h.participant.episodes


async def test_the_next_restore_waits_for_a_kept_install(h: Harness) -> None:
    await committed(h, "r1", "r2")
    h.participant.install_gate = gate = Gate()
    body = {"checkpoint_dir": str(h.directory), "episode_ids": [wire("r1")]}
    await h.error("restore", "deadline_exceeded", checkpoint_id="restore-1", **body, deadline_ts=time.time() + 0.4)
    await h.call("resume", checkpoint_id="restore-1")
    h.participant.install_gate = None
    second = asyncio.create_task(
        h.call("restore", checkpoint_id="restore-2", checkpoint_dir=str(h.directory), episode_ids=[wire("r2")])
    )
    await wait_until(lambda: h.plane.phase == "restored", what="the second restore to start")
    assert len(h.participant.called("install")) == 1
    gate.release()
    assert (await second)["restored"] == ["r2-a1"]
    assert len(h.participant.called("install")) == 2


async def test_retire_marks_first_then_stops_and_frees(h: Harness) -> None:
    h.participant.add("r1", "r1-a1", "r2")
    h.participant.retire_gate = gate = Gate()
    retire = asyncio.create_task(h.call("retire", checkpoint_id="ops-1", episode_ids=[wire("r1-a1")]))
    await asyncio.wait_for(gate.entered.wait(), 5)
    assert h.plane.marks.is_retired("r1", 0) and h.plane.marks.is_retired("r1", 1)
    assert "r1-a1" in h.participant.episodes  # not freed before the hook finished
    gate.release()
    assert await retire == {"retired_count": 1}
    assert "r1-a1" not in h.participant.episodes


async def test_a_retire_that_runs_out_of_time_keeps_its_marks(h: Harness) -> None:
    h.participant.retire_gate = gate = Gate()
    await h.error(
        "retire", "deadline_exceeded", checkpoint_id="ops-1", episode_ids=[wire("r7-a3")], deadline_ts=time.time() + 0.4
    )
    assert h.plane.marks.is_retired("r7", 3)
    gate.release()


async def test_marks_only_rise(h: Harness) -> None:
    await h.call("retire", checkpoint_id="ops-1", episode_ids=[wire("r1-a3")])
    await h.call("retire", checkpoint_id="ops-2", episode_ids=[wire("r1-a1")])
    assert h.plane.marks.retired_up_to("r1") == 3


async def test_retire_and_forget_are_refused_while_checkpointing_and_mark_nothing(h: Harness) -> None:
    h.participant.blockers = {"r5"}
    await h.call("prepare", checkpoint_id="c1", deadline_ts=time.time() + 0.3)
    assert h.plane.phase == "preparing"
    await h.error("retire", "invalid_phase", checkpoint_id="c1", episode_ids=[wire("r1")])
    await h.error("forget", "invalid_phase", checkpoint_id="c1", rollout_ids=["r1"])
    h.participant.unblock("r5")
    await h.call("prepare", checkpoint_id="c1")
    await h.error("retire", "invalid_phase", checkpoint_id="c1", episode_ids=[wire("r1")])
    await h.call("commit", checkpoint_id="c1", checkpoint_dir=str(h.directory), episode_ids=None)
    await h.error("retire", "invalid_phase", checkpoint_id="c1", episode_ids=[wire("r1")])
    await h.error("forget", "invalid_phase", checkpoint_id="c1", rollout_ids=["r1"])
    assert len(h.plane.marks) == 0 and h.participant.called("retire") == []


async def test_after_a_restore_retire_and_forget_must_name_it(h: Harness) -> None:
    await committed(h, "r1")
    await h.call("restore", checkpoint_id="restore-1", checkpoint_dir=str(h.directory), episode_ids=[wire("r1")])
    await h.error("retire", "checkpoint_conflict", checkpoint_id="other", episode_ids=[wire("r1-a1")])
    await h.error("forget", "checkpoint_conflict", checkpoint_id="other", rollout_ids=["r1"])
    assert not h.plane.marks.is_retired("r1", 1)
    assert await h.call("retire", checkpoint_id="restore-1", episode_ids=[wire("r1-a1")]) == {"retired_count": 1}
    assert h.plane.marks.is_retired("r1", 1)


async def test_forget_removes_marks_and_counts_what_was_named(h: Harness) -> None:
    await h.call("retire", checkpoint_id="ops-1", episode_ids=[wire("r1"), wire("r2-a2")])
    assert await h.call("forget", checkpoint_id="anything", rollout_ids=["r1", "never-marked"]) == {
        "forgotten_count": 2
    }
    assert not h.plane.marks.is_retired("r1", 0) and h.plane.marks.is_retired("r2", 2)
    assert (await h.status())["retired_rollouts"] == 1


async def test_status_names_the_first_100_marks_and_counts_them_all(h: Harness) -> None:
    await h.call("retire", checkpoint_id="ops-1", episode_ids=[wire("r2-a2"), wire("r1")])
    assert (await h.status())["retired_marks"] == {"r1": 0, "r2": 2}
    await h.call("retire", checkpoint_id="ops-2", episode_ids=[wire(f"m{i:03d}-a1") for i in range(150)])
    status = await h.status()
    # Bounded by name (a controller names leftovers from it), counted in full.
    assert status["retired_rollouts"] == 152
    assert status["retired_marks"] == {f"m{i:03d}": 1 for i in range(100)}  # the first 100 rollout ids


async def test_install_error_that_is_typed_keeps_its_code(tmp_path: Path) -> None:
    participant = Participant()
    harness = await make_harness(tmp_path, participant)
    try:
        await committed(harness, "r1")
        participant.install_error = InvalidCheckpointState("record r1 names an unknown tool")
        await harness.error(
            "restore",
            "invalid_checkpoint_state",
            checkpoint_id="restore-1",
            checkpoint_dir=str(harness.directory),
            episode_ids=[wire("r1")],
        )
        assert harness.plane.admission.is_open
    finally:
        await close_harness(harness)


async def test_hook_forgotten_hears_each_forget_after_its_marks_are_gone(h: Harness) -> None:
    await h.call("retire", checkpoint_id="r", episode_ids=[wire("r1")])
    assert await h.call("forget", checkpoint_id="f1", rollout_ids=["r1", "r2"]) == {"forgotten_count": 2}
    assert h.participant.called("forgotten") == [{"rollout_ids": ["r1", "r2"]}]
    assert not h.plane.marks.is_retired("r1", 0)
    # A refused forget (a checkpoint open) tells no plugin anything.
    h.participant.add("r3")
    await h.call("prepare", checkpoint_id="c1", deadline_ts=time.time() + 10)
    await h.error("forget", "invalid_phase", checkpoint_id="c1", rollout_ids=["r3"])
    assert len(h.participant.called("forgotten")) == 1
