"""The environment participant (``EpisodeBook``) in process: steps, boundaries, readiness, restarts, retire.

Episodes here are plain asyncio tasks that follow the book's contract (``begin``, ``step``,
``reach``, ``park``, ``end``); prepares go through a real ``ControlPlane``, so reports are
the ones the wire carries.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from control_support import wait_until
from nemo_gym_checkpoint_plugin.builtin_participants.environment.episode_book import EpisodeBook, StepMode
from nemo_gym_checkpoint_plugin.builtin_participants.environment.steps import validate_state

from nemo_gym_checkpoint_plugin._control import ControlPlane
from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._plugins import make_plugin_manager
from nemo_gym_checkpoint_plugin._settings import SettingsError, settings_from_global_config
from nemo_gym_checkpoint_plugin._types import RestoredRecord, plain_records


def _plane(book: EpisodeBook) -> ControlPlane:
    return ControlPlane(make_plugin_manager([book], load_entry_points=False), kind="environment", instance="env")


class Run:
    """One episode attempt: a seed step, then a step that waits on ``gate``, then the last boundary."""

    def __init__(self, book: EpisodeBook, rollout_id: str, attempt: int = 0, *, timeout: float | None = None) -> None:
        self.book = book
        self.episode_id = EpisodeId(rollout_id=rollout_id, attempt=attempt)
        self.gate = asyncio.Event()
        self.steps_run: list[str] = []
        self.timeout = timeout
        self.episode: Any = None
        # Raised by the work step once its gate opens (a step that fails).
        self.error: BaseException | None = None
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> str:
        episode = self.episode = self.book.begin(self.episode_id)
        try:
            async with asyncio.timeout(self.timeout) as deadline:
                episode.deadline = deadline
                if episode.boundary is None:
                    async with self.book.step(episode, "seed"):
                        self.steps_run.append("seed")
                    self.book.reach(episode, "seeded", {"n": 1})
                if episode.boundary == "seeded":
                    async with self.book.step(episode, "work"):
                        self.steps_run.append("work")
                        await self.gate.wait()
                        if self.error is not None:
                            raise self.error
                    self.book.reach(episode, "worked", {"n": 2})
                await self.book.park(episode)
                return "done"
        finally:
            self.book.end(episode)

    async def in_step(self, name: str) -> None:
        await wait_until(lambda: self.episode is not None and self.episode.step == name, what=f"step {name}")


def _deadline() -> float:
    return time.time() + 10.0


async def test_wait_mode_prepare_waits_for_steps_in_flight_then_every_episode_is_parked() -> None:
    book = EpisodeBook(StepMode.WAIT)
    plane = _plane(book)
    runs = [Run(book, f"r{i}") for i in range(3)]
    for run in runs:
        await run.in_step("work")
    preparing = asyncio.ensure_future(plane.prepare("c1", _deadline()))
    await wait_until(lambda: plane.phase == "preparing", what="preparing")
    report = (await plane.status())["report"]
    assert report["ready"] is False and report["blockers"] == ["r0", "r1", "r2"]
    runs[0].gate.set()
    await wait_until(lambda: runs[0].episode.parked, what="r0 parked")
    assert (await plane.status())["report"]["blockers"] == ["r1", "r2"]
    assert not preparing.done()
    for run in runs[1:]:
        run.gate.set()
    reply = await preparing
    assert reply["phase"] == "prepared" and reply["report"]["ready"] is True
    assert reply["report"]["counts"]["parked"] == 3
    exported = plain_records((await plane.participants.export("c1", None)).records)
    boundaries = {r["episode_id"]["rollout_id"]: r["boundary"] for r in exported}
    assert boundaries == {"r0": "worked", "r1": "worked", "r2": "worked"}
    assert not any(run.task.done() for run in runs)  # the last boundary parks: nobody finishes while prepared
    await plane.resume("c1", _deadline())
    assert await asyncio.gather(*(run.task for run in runs)) == ["done"] * 3
    await plane.aclose()


async def test_replay_mode_step_in_flight_does_not_block_and_is_exported_at_its_last_boundary() -> None:
    book = EpisodeBook(StepMode.REPLAY)
    plane = _plane(book)
    run = Run(book, "r")
    await run.in_step("work")
    reply = await plane.prepare("c1", _deadline())
    assert reply["phase"] == "prepared" and reply["report"]["blockers"] == []
    (record,) = plain_records((await plane.participants.export("c1", frozenset({"r"}))).records)
    assert record["boundary"] == "seeded" and record["state"] == {"n": 1} and record["step_mode"] == "replay"
    await plane.resume("c1", _deadline())
    run.gate.set()
    assert await run.task == "done"
    await plane.aclose()


async def test_report_lists_at_most_100_blockers_with_the_full_count() -> None:
    book = EpisodeBook(StepMode.WAIT)
    plane = _plane(book)
    runs = [Run(book, f"r{i:03d}") for i in range(150)]
    await wait_until(lambda: all(r.episode is not None and r.episode.step == "work" for r in runs), what="all in step")
    reply = await plane.prepare("c1", time.time() + 0.3)
    assert reply["phase"] == "preparing"
    assert len(reply["report"]["blockers"]) == 100 and reply["report"]["blocker_count"] == 150
    await plane.resume("c1", _deadline())
    for run in runs:
        run.gate.set()
    await asyncio.gather(*(run.task for run in runs))
    await plane.aclose()


async def test_readiness_outside_a_checkpoint_keeps_no_running_set() -> None:
    book = EpisodeBook(StepMode.WAIT)
    run = Run(book, "r")
    await run.in_step("work")
    assert book._blocking == set()  # steps outside a checkpoint touch only their own episode
    assert list(book.ready(None).blockers) == ["r"]  # a status call computes it on demand
    run.gate.set()
    await run.task
    assert book._blocking == set()


async def test_restart_is_listed_never_blocks_never_parks_and_is_never_exported() -> None:
    book = EpisodeBook(StepMode.WAIT)
    plane = _plane(book)
    restart, kept = Run(book, "s"), Run(book, "k")
    await restart.in_step("work")
    await kept.in_step("work")
    book.declare_restart(restart.episode)
    kept.gate.set()
    reply = await plane.prepare("c1", _deadline())
    assert reply["report"]["restarts"] == ["s"] and reply["report"]["blockers"] == []
    restart.gate.set()
    assert await restart.task == "done"  # a restart runs through the checkpoint
    records = plain_records((await plane.participants.export("c1", None)).records)
    assert [r["episode_id"]["rollout_id"] for r in records] == ["k"]
    await plane.resume("c1", _deadline())
    await kept.task
    await plane.aclose()


async def test_restart_declared_while_a_checkpoint_is_open_waits_for_resume() -> None:
    book = EpisodeBook(StepMode.REPLAY)
    plane = _plane(book)
    run = Run(book, "s")
    await run.in_step("work")
    await plane.prepare("c1", _deadline())
    book.declare_restart(run.episode)
    assert list(book.ready("c1").restarts) == []  # the prepare's report cannot change before its commit
    (record,) = plain_records((await plane.participants.export("c1", None)).records)
    assert record["boundary"] is None  # it cannot continue from its sessions: it starts over
    await plane.resume("c1", _deadline())
    assert list(book.ready(None).restarts) == ["s"]
    run.gate.set()
    await run.task
    await plane.aclose()


async def test_episode_being_retired_blocks_and_is_not_exported_until_its_task_ended() -> None:
    book = EpisodeBook(StepMode.REPLAY)
    release_cleanup = asyncio.Event()
    book_episode: dict[str, Any] = {}

    async def episode_with_slow_cleanup() -> None:
        episode = book_episode["e"] = book.begin(EpisodeId(rollout_id="r", attempt=0))
        try:
            async with book.step(episode, "work"):
                await asyncio.Event().wait()
        finally:
            await release_cleanup.wait()  # cleanup outlives the cancellation
            book.end(episode)

    task = asyncio.ensure_future(episode_with_slow_cleanup())
    await wait_until(lambda: "e" in book_episode and book_episode["e"].step == "work", what="in step")
    retiring = asyncio.ensure_future(book.retire([EpisodeId(rollout_id="r", attempt=0)]))
    await wait_until(lambda: book_episode["e"].retiring, what="retiring")
    book.close_admission("c1")
    assert list(book.ready("c1").blockers) == ["r"]  # replay mode, but retiring blocks
    assert plain_records(book.export("c1", None).records) == []
    assert not retiring.done()
    release_cleanup.set()
    await retiring
    assert task.cancelled()
    assert list(book.ready("c1").blockers) == []
    book.open_admission("c1")


async def test_time_parked_does_not_count_against_the_episode_deadline() -> None:
    book = EpisodeBook(StepMode.WAIT)
    plane = _plane(book)
    run = Run(book, "r", timeout=0.5)
    await run.in_step("work")
    preparing = asyncio.ensure_future(plane.prepare("c1", _deadline()))
    await wait_until(lambda: plane.phase == "preparing", what="preparing")
    run.gate.set()
    await preparing
    loop = asyncio.get_running_loop()
    parked_from = loop.time()
    assert run.episode.parked
    # Parked past the whole episode deadline: it must not fire.
    await wait_until(lambda: loop.time() - parked_from > 0.8, what="the deadline's span to pass", timeout=5.0)
    assert not run.task.done()
    await plane.resume("c1", _deadline())
    assert await run.task == "done"
    await plane.aclose()


async def test_wait_ready_wakes_when_a_blocker_clears() -> None:
    book = EpisodeBook(StepMode.WAIT)
    run = Run(book, "r")
    await run.in_step("work")
    book.close_admission("c1")
    assert list(book.ready("c1").blockers) == ["r"]
    waiter = asyncio.ensure_future(book.wait_ready("c1"))
    await asyncio.sleep(0)  # wait-ok: one loop turn, so the waiter is waiting before the change
    assert not waiter.done()
    run.gate.set()
    await asyncio.wait_for(waiter, 5.0)
    book.open_admission("c1")
    await run.task


def _restored(rollout_id: str, boundary: str | None, state: dict[str, Any]) -> RestoredRecord:
    checkpointed = EpisodeId(rollout_id=rollout_id, attempt=0)
    record = {"episode_id": {"rollout_id": rollout_id, "attempt": 0}, "boundary": boundary, "state": state}
    return RestoredRecord(checkpointed, EpisodeId(rollout_id=rollout_id, attempt=1), record)


async def test_restored_episode_starts_at_its_boundary_as_the_next_attempt() -> None:
    book = EpisodeBook(StepMode.WAIT)
    book.install("r1", {}, [_restored("a", "seeded", {"n": 1}), _restored("b", None, {})])
    assert sorted(book.restored_pending()) == ["a-a1", "b-a1"]
    continued, fresh = Run(book, "a", attempt=1), Run(book, "b", attempt=1)
    continued.gate.set()
    fresh.gate.set()
    await asyncio.gather(continued.task, fresh.task)
    assert continued.steps_run == ["work"]  # no seed again
    assert fresh.steps_run == ["seed", "work"]  # no boundary: starts over from its input
    assert book.restored_pending() == []


async def test_install_refuses_a_bad_record_and_keeps_nothing() -> None:
    book = EpisodeBook(StepMode.WAIT, validate_state=validate_state)
    good = _restored("a", None, {})
    bad = _restored("b", "replied", {"resources_session_id": "s"})
    with pytest.raises(ValueError, match="lacks state"):
        book.install("r1", {}, [good, bad])
    assert book.restored_pending() == []


async def test_delete_restored_and_retire_drop_pending_replacements() -> None:
    book = EpisodeBook(StepMode.WAIT)
    book.install("r1", {}, [_restored("a", None, {}), _restored("b", None, {})])
    book.delete_restored([EpisodeId(rollout_id="a", attempt=1)])
    assert book.restored_pending() == ["b-a1"]
    await book.retire([EpisodeId(rollout_id="b", attempt=1)])
    assert book.restored_pending() == []


def test_step_mode_comes_from_the_checkpoint_block_and_is_validated() -> None:
    assert settings_from_global_config({"checkpoint": {}}).step_mode == StepMode.WAIT
    assert settings_from_global_config({"checkpoint": {"step_mode": "replay"}}).step_mode == StepMode.REPLAY
    with pytest.raises(SettingsError, match="checkpoint.step_mode"):
        settings_from_global_config({"checkpoint": {"step_mode": "later"}})


async def test_begin_refuses_a_retired_attempt_once_marks_are_bound() -> None:
    from nemo_gym_checkpoint_plugin._admission import RetiredMarks
    from nemo_gym_checkpoint_plugin._errors import StaleAttempt

    book, marks = EpisodeBook(), RetiredMarks()
    marks.mark("r", 1)
    book.begin(EpisodeId(rollout_id="r", attempt=0))  # unbound: the book knows no marks
    book.bind_marks(marks)
    with pytest.raises(StaleAttempt, match="retired up to attempt 1"):
        book.begin(EpisodeId(rollout_id="r", attempt=1))
    assert book.status_fields()["episodes"] == 1
    assert book.begin(EpisodeId(rollout_id="r", attempt=2)).key == "r-a2"


async def test_a_retried_retire_waits_for_the_cancelled_work_without_cancelling_it_again() -> None:
    book = EpisodeBook(StepMode.WAIT)
    release_cleanup = asyncio.Event()
    cleanup_done: list[str] = []
    started: dict[str, Any] = {}

    async def episode_with_cleanup() -> str:
        episode = started["e"] = book.begin(EpisodeId(rollout_id="r", attempt=0))
        try:
            async with book.step(episode, "work"):
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            if not book.absorb_retirement(episode):
                raise
            # The episode's cleanup after a retire: it takes a moment (until released).
            started["cleaning"] = True
            await release_cleanup.wait()
            cleanup_done.append("closed")
            return "retired"
        finally:
            book.end(episode)
        return "done"

    task = asyncio.ensure_future(episode_with_cleanup())
    await wait_until(lambda: "e" in started and started["e"].step == "work", what="in step")
    named = [EpisodeId(rollout_id="r", attempt=0)]
    first = asyncio.ensure_future(book.retire(named))
    await wait_until(lambda: started.get("cleaning", False), what="cleanup running")
    # The first retire's deadline passed (say); the controller retries it.
    second = asyncio.ensure_future(book.retire(named))
    for _ in range(20):
        await asyncio.sleep(0)  # let the second retire run as far as it can (no I/O: a few passes)
    assert not second.done() and not task.done()
    release_cleanup.set()
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert cleanup_done == ["closed"] and task.result() == "retired"


@pytest.mark.parametrize("mode", [StepMode.WAIT, StepMode.REPLAY])
async def test_a_captured_step_never_blocks_and_what_follows_hand_back_blocks_in_either_mode(mode: StepMode) -> None:
    book = EpisodeBook(mode)
    delegated, replied, closing, close = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def run() -> None:
        episode = book.begin(EpisodeId(rollout_id="turn", attempt=0))
        try:
            async with book.step(episode, "agent", captured=True):
                delegated.set()
                await replied.wait()  # the agent's turn (it records its own boundaries)
                await book.hand_back(episode)
                closing.set()
                await close.wait()  # closing the agent session: must not run twice
            book.reach(episode, "replied", {})
        finally:
            book.end(episode)

    task = asyncio.ensure_future(run())
    await asyncio.wait_for(delegated.wait(), 5)
    book.close_admission("ck-1")
    assert list(book.ready("ck-1").blockers) == []  # the delegated turn never blocks
    replied.set()
    await wait_until(lambda: book.ready("ck-1").counts["parked"] == 1)  # parks before closing the session
    assert not closing.is_set()
    book.open_admission("ck-1")
    await asyncio.wait_for(closing.wait(), 5)
    book.close_admission("ck-2")
    assert list(book.ready("ck-2").blockers) == ["turn"]  # the close in flight blocks, whatever the mode
    close.set()
    await asyncio.wait_for(task, 5)
    assert list(book.ready("ck-2").blockers) == []
    book.open_admission("ck-2")


async def test_one_retire_of_many_attempts_stops_exactly_those_and_the_earlier_ones() -> None:
    book = EpisodeBook(StepMode.WAIT)
    runs = {f"r{i}": Run(book, f"r{i}") for i in range(6)}
    runs["r6"] = Run(book, "r6", attempt=2)
    await wait_until(
        lambda: all(r.episode is not None and r.episode.step == "work" for r in runs.values()),
        what="every episode in its step",
    )
    book.install("c1", {}, [_restored("r1", "seeded", {}), _restored("r5", "seeded", {})])
    # r1 up to attempt 1 names its running attempt 0 and its restored attempt 1; r6 up to 3 names attempt 2.
    named = [
        EpisodeId(rollout_id="r0"),
        EpisodeId(rollout_id="r1", attempt=1),
        EpisodeId(rollout_id="r2"),
        EpisodeId(rollout_id="r6", attempt=3),
    ]
    await asyncio.wait_for(book.retire(named), 10)
    stopped = {name for name, run in runs.items() if run.task.done()}
    assert stopped == {"r0", "r1", "r2", "r6"} and all(runs[n].task.cancelled() for n in stopped)
    assert book.restored_pending() == ["r5-a1"]
    assert sorted(book.status_fields()["episode_keys"]) == ["r3", "r4", "r5", "r5-a1"]
    for name in ("r3", "r4", "r5"):
        runs[name].gate.set()
    assert await asyncio.wait_for(asyncio.gather(*(runs[n].task for n in ("r3", "r4", "r5"))), 10) == ["done"] * 3


async def test_a_replacement_carrying_another_task_is_refused_naming_the_episode() -> None:
    # Issue 30: the record keeps a digest of the task its attempt ran; the replacement /run must carry it.
    from nemo_gym_checkpoint_plugin._errors import TaskMismatch

    book = EpisodeBook(StepMode.WAIT)
    task = {"task_id": {"taskset": "t", "task_id": "7"}, "task_input": {"q": "2+2"}}
    first = book.begin(EpisodeId(rollout_id="a", attempt=0), task)
    book.reach(first, "seeded", {"n": 1})
    (record,) = plain_records(book.export("c1", None).records)
    book.end(first)
    checkpointed = EpisodeId(rollout_id="a", attempt=0)
    book.install("r1", {}, [RestoredRecord(checkpointed, EpisodeId(rollout_id="a", attempt=1), dict(record))])
    other = {"task_id": {"taskset": "t", "task_id": "8"}, "task_input": {"q": "3+3"}}
    replacement = EpisodeId(rollout_id="a", attempt=1)
    with pytest.raises(TaskMismatch, match="episode a-a1") as refused:
        book.claim(replacement, other)
    assert refused.value.to_body()["error"]["code"] == "task_mismatch"
    assert refused.value.to_body()["error"]["episode_ids"] == ["a-a1"]
    with pytest.raises(TaskMismatch):
        book.begin(replacement, other)
    # Nothing ran: the record is still pending for the /run carrying its task, which continues it.
    assert book.restored_pending() == ["a-a1"]
    book.release(book.claim(replacement, dict(reversed(list(task.items())))))  # key order is no other task
    continued = book.begin(replacement, task)
    assert continued.boundary == "seeded" and continued.state == {"n": 1}
    book.end(continued)


async def test_a_record_without_a_task_digest_still_restores_whatever_task() -> None:
    # Records of an earlier version (or Gym's own checkpoints) carry no task_digest.
    book = EpisodeBook(StepMode.WAIT)
    book.install("r1", {}, [_restored("a", "seeded", {"n": 1})])
    continued = book.begin(EpisodeId(rollout_id="a", attempt=1), {"task_id": {"taskset": "t", "task_id": "9"}})
    assert continued.boundary == "seeded"
    book.end(continued)


async def test_a_replay_step_that_raises_while_a_checkpoint_is_open_starts_over_after_a_crash(tmp_path: Any) -> None:
    # Issue 30: the step in flight does not block (replay mode); it raises after prepare. Its episode ended:
    # the commit exports nothing of it (neither its last boundary nor the step's half), so after a crash the
    # restore installs only the other episode and the failed one starts over from its input.
    book = EpisodeBook(StepMode.REPLAY)
    plane = _plane(book)
    failing, other = Run(book, "r"), Run(book, "s")
    failing.error = RuntimeError("the model call failed")
    await failing.in_step("work")
    await other.in_step("work")
    reply = await plane.prepare("c1", _deadline())
    assert reply["phase"] == "prepared" and reply["report"]["blockers"] == []
    failing.episode.state["n"] = "half"  # what the failing step changed before it raised
    failing.gate.set()
    with pytest.raises(RuntimeError, match="model call failed"):
        await failing.task
    assert book.ready("c1").blockers == [] and book.ready("c1").counts["episodes"] == 1
    scope = [EpisodeId(rollout_id="r", attempt=0), EpisodeId(rollout_id="s", attempt=0)]
    committed = await plane.commit("c1", _deadline(), str(tmp_path), scope)
    assert committed["episode_ids"] == ["s"]  # r is not exported: the controller sends it again
    await plane.aclose()  # the crash: nothing resumes
    other.task.cancel()

    restored_book = EpisodeBook(StepMode.REPLAY)
    restored_plane = _plane(restored_book)
    restored = await restored_plane.restore("x1", _deadline(), str(tmp_path), scope)
    assert restored["restored"] == ["s-a1"]
    await restored_plane.resume("x1", _deadline())
    again, continued = Run(restored_book, "r", attempt=1), Run(restored_book, "s", attempt=1)
    again.gate.set()
    continued.gate.set()
    assert await asyncio.gather(again.task, continued.task) == ["done", "done"]
    assert again.steps_run == ["seed", "work"]  # started over from its input
    assert continued.steps_run == ["work"]  # the replayed step runs again from its boundary
    await restored_plane.aclose()


async def test_a_retire_stops_its_episodes_concurrently_a_bounded_number_at_a_time() -> None:
    # Issue 30: the retire stopped every episode at once, unbounded; now at most retire_concurrency at a time.
    book = EpisodeBook(StepMode.WAIT)
    book.retire_concurrency = 3
    release = asyncio.Event()
    cleaning: list[str] = []
    cleaned: list[str] = []
    started: dict[str, Any] = {}

    async def episode_with_slow_cleanup(rollout_id: str) -> None:
        episode = started[rollout_id] = book.begin(EpisodeId(rollout_id=rollout_id, attempt=0))
        try:
            async with book.step(episode, "work"):
                await asyncio.Event().wait()
        finally:
            cleaning.append(rollout_id)
            await release.wait()  # the cleanup of a stopped episode (closing its sessions) takes a while
            cleaned.append(rollout_id)
            book.end(episode)

    tasks = [asyncio.ensure_future(episode_with_slow_cleanup(f"r{i}")) for i in range(7)]
    await wait_until(lambda: len(started) == 7 and all(e.step == "work" for e in started.values()), what="in step")
    retire = asyncio.ensure_future(book.retire([EpisodeId(rollout_id=f"r{i}", attempt=0) for i in range(7)]))
    await wait_until(lambda: len(cleaning) == 3, what="three episodes stopping")
    for _ in range(20):
        await asyncio.sleep(0)  # wait-ok: yields to the loop, no duration stands in for a condition
    assert len(cleaning) == 3 and not retire.done()  # concurrent, and no more than the bound
    release.set()
    await asyncio.wait_for(retire, 10)
    assert sorted(cleaned) == [f"r{i}" for i in range(7)] and all(t.cancelled() for t in tasks)
