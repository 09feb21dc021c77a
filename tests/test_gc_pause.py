"""A restore pauses Python's cyclic garbage collector from its read until its install ended, and a commit
while it exports and writes; each leaves it as it found it: enabled again after (or after a failure), still
disabled if it was disabled before. A checkpoint or restore freezes the heap from its beginning until it
ends (resume, lease expiry, shutdown), and so does the coordinator's fan-out of each operation, so that no
full collection of the heap lands inside one; a process that froze objects itself keeps them frozen."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from control_support import Gate, Harness, close_harness, make_harness, wait_until, wire

from nemo_gym_checkpoint_plugin._gc_pause import gc_paused, heap_frozen, hold_heap, promote_to_oldest


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await make_harness(tmp_path)
    yield harness
    await close_harness(harness)


@pytest.fixture(autouse=True)
def gc_back_on() -> Iterator[None]:
    assert gc.get_freeze_count() == 0, "an earlier test left the heap frozen"
    yield
    gc.enable()
    gc.unfreeze()


def _oldest() -> set[int]:
    return {id(obj) for obj in gc.get_objects(generation=2)}


def _young() -> set[int]:
    return {id(obj) for generation in (0, 1) for obj in gc.get_objects(generation=generation)}


async def checkpointed(h: Harness) -> None:
    h.participant.add("r1", "r2")
    await h.checkpoint("c1", ["r1", "r2"])
    await h.call("resume", checkpoint_id="c1")
    h.participant.episodes.clear()


async def test_gc_is_paused_during_the_install_and_enabled_after(h: Harness) -> None:
    await checkpointed(h)
    h.participant.install_gate = gate = Gate()
    assert gc.isenabled()
    restore = asyncio.create_task(
        h.call("restore", checkpoint_id="r-1", checkpoint_dir=str(h.directory), episode_ids=[wire("r1"), wire("r2")])
    )
    await asyncio.wait_for(gate.entered.wait(), 10)
    assert not gc.isenabled()  # the records are read and being installed
    gate.release()
    assert (await restore)["restored"] == ["r1-a1", "r2-a1"]
    assert gc.isenabled()


async def test_a_failed_restore_enables_gc_again(h: Harness) -> None:
    await checkpointed(h)
    h.participant.install_error = ValueError("refused")
    await h.error(
        "restore",
        "invalid_checkpoint_state",
        checkpoint_id="r-1",
        checkpoint_dir=str(h.directory),
        episode_ids=[wire("r1")],
    )
    assert gc.isenabled()
    await h.error(
        "restore",
        "invalid_checkpoint_state",
        checkpoint_id="r-2",
        checkpoint_dir=str(h.directory / "nowhere"),
        episode_ids=[wire("r1")],
    )
    assert gc.isenabled()


async def test_gc_disabled_before_stays_disabled(h: Harness) -> None:
    await checkpointed(h)
    gc.disable()
    await h.call("restore", checkpoint_id="r-1", checkpoint_dir=str(h.directory), episode_ids=[wire("r1")])
    assert not gc.isenabled()


def test_pauses_nest() -> None:
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


async def test_gc_is_paused_while_a_commit_exports_and_writes_and_enabled_after(h: Harness) -> None:
    seen: list[bool] = []

    def observed(records: list) -> Iterator:
        for record in records:
            seen.append(gc.isenabled())  # the writer thread iterates the records while it encodes them
            yield record

    h.participant.add("r1", "r2")
    h.participant.export_gate = gate = Gate()
    h.participant.records_wrapper = observed
    await h.call("prepare", checkpoint_id="c1")
    commit = asyncio.create_task(
        h.call("commit", checkpoint_id="c1", checkpoint_dir=str(h.directory), episode_ids=[wire("r1"), wire("r2")])
    )
    await asyncio.wait_for(gate.entered.wait(), 10)
    assert not gc.isenabled()  # the participant is exporting
    gate.release()
    assert (await commit)["episode_ids"] == ["r1", "r2"]
    assert seen == [False, False]
    assert gc.isenabled()


async def test_a_restore_leaves_the_installed_records_in_the_oldest_generation(h: Harness) -> None:
    h.participant.add(*(f"r{i}" for i in range(50)))
    await h.checkpoint("c1", [f"r{i}" for i in range(50)])
    await h.call("resume", checkpoint_id="c1")
    h.participant.episodes.clear()
    await h.call(
        "restore", checkpoint_id="r-1", checkpoint_dir=str(h.directory), episode_ids=[wire(f"r{i}") for i in range(50)]
    )
    installed = list(h.participant.episodes.values())
    assert len(installed) == 50
    # Promoted at once: the first allocation after the pause does not traverse them in a young collection.
    young = _young()
    assert not any(id(record) in young for record in installed)
    assert gc.isenabled() and gc.get_freeze_count() > 0  # frozen with the heap until the restore ends
    await h.call("resume", checkpoint_id="r-1")
    assert gc.get_freeze_count() == 0
    oldest = _oldest()
    assert all(id(record) in oldest for record in installed)


async def test_a_process_that_froze_objects_keeps_them_frozen(h: Harness) -> None:
    await checkpointed(h)
    gc.freeze()
    try:
        assert gc.get_freeze_count() > 0
        await h.call("restore", checkpoint_id="r-1", checkpoint_dir=str(h.directory), episode_ids=[wire("r1")])
        assert gc.get_freeze_count() > 0  # not handed back to the generations by the restore
    finally:
        gc.unfreeze()


async def test_a_checkpoint_freezes_the_heap_from_prepare_until_resume(h: Harness) -> None:
    before = [[i] for i in range(3)]
    h.participant.add("r1")
    await h.call("prepare", checkpoint_id="c1")
    frozen = gc.get_freeze_count()
    assert frozen > 0
    during = [[i] for i in range(3)]
    young = _young()
    # What existed is out of every collection's reach; what the checkpoint allocates is still collected.
    assert not any(id(item) in young for item in before)
    assert all(id(item) in young for item in during)
    await h.call("commit", checkpoint_id="c1", checkpoint_dir=str(h.directory), episode_ids=[wire("r1")])
    assert gc.get_freeze_count() > 0
    await h.call("resume", checkpoint_id="c1")
    assert gc.get_freeze_count() == 0
    oldest = _oldest()
    assert all(id(item) in oldest for item in before)


async def test_a_checkpoint_whose_lease_expires_thaws_the_heap(tmp_path: Path) -> None:
    harness = await make_harness(tmp_path, grace_seconds=0.3, retry_seconds=0.2)
    try:
        await harness.call("prepare", checkpoint_id="c1", deadline_ts=time.time() + 0.2)
        assert gc.get_freeze_count() > 0
        await wait_until(lambda: harness.plane.phase == "idle", timeout=10, what="the self-resume")
        assert harness.plane.lease.self_resumes == 1 and gc.get_freeze_count() == 0
    finally:
        await close_harness(harness)


async def test_a_plane_closed_mid_checkpoint_thaws_the_heap(tmp_path: Path) -> None:
    harness = await make_harness(tmp_path)
    await harness.call("prepare", checkpoint_id="c1")
    assert gc.get_freeze_count() > 0
    await close_harness(harness)
    assert gc.get_freeze_count() == 0


def test_holds_nest_and_release_once() -> None:
    first = hold_heap()
    with heap_frozen():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() > 0  # the first hold still stands
    first.release()
    first.release()  # idempotent: never releases another hold
    assert gc.get_freeze_count() == 0


def test_a_promotion_while_held_stays_frozen_and_lands_in_the_oldest_generation() -> None:
    with heap_frozen():
        made = [[i] for i in range(3)]
        promote_to_oldest()
        assert not any(id(item) in _young() for item in made)
        assert gc.get_freeze_count() > 0
    assert all(id(item) in _oldest() for item in made)


def test_a_hold_leaves_a_heap_the_process_froze_itself_frozen() -> None:
    gc.freeze()
    own = gc.get_freeze_count()
    with heap_frozen():
        pass
    assert gc.get_freeze_count() == own  # not handed back to the generations
