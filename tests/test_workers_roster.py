"""The coordinator's roster (``_workers/roster.py``) over real links: registration, losses, readiness."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_checkpoint_plugin._workers.link import Link, LinkClosed, LinkRemoteError, LinkTimeout, connect, serve
from nemo_gym_checkpoint_plugin._workers.roster import REGISTER_OP, Roster

TIMEOUT = 2.0


class Coordinator:
    """A roster behind a real Unix socket, with a snapshot the test controls."""

    def __init__(self, expected: int, path: str) -> None:
        self.path = path
        self.state: dict[str, Any] = {"marks": {}, "admission": "open"}
        self.roster = Roster(expected, snapshot=lambda: dict(self.state))
        self.server: asyncio.Server | None = None
        self.workers: list[Link] = []

    async def _handle(self, link: Link, op: str, body: Any) -> Any:
        if op == REGISTER_OP:
            return self.roster.register(link, body)
        raise ValueError(f"unknown op {op}")

    async def start(self) -> None:
        self.server = await serve(self.path, lambda _link: None, handler=self._handle)

    async def worker(self, pid: int, handler: Any = None) -> tuple[Link, dict[str, Any]]:
        link = await connect(self.path, timeout=TIMEOUT, handler=handler)
        self.workers.append(link)
        return link, await link.call(REGISTER_OP, {"pid": pid}, timeout=TIMEOUT)

    async def until(self, condition: Any) -> None:
        async with asyncio.timeout(TIMEOUT):
            while not condition():
                await self.roster.changed(TIMEOUT)

    async def aclose(self) -> None:
        await asyncio.gather(*(link.aclose() for link in self.workers))
        await self.roster.aclose()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    directory = tempfile.mkdtemp(prefix="rst", dir="/tmp")
    made = Coordinator(3, str(Path(directory) / "c.sock"))
    await made.start()
    yield made
    await made.aclose()
    shutil.rmtree(directory, ignore_errors=True)


async def _answer_ready(_link: Link, op: str, body: Any) -> Any:
    return {"op": op, "ready": True}


async def _never_answer(_link: Link, op: str, body: Any) -> Any:
    await asyncio.Event().wait()


async def test_a_late_registrant_gets_the_current_marks_and_admission(coordinator: Coordinator) -> None:
    _, first = await coordinator.worker(101)
    assert first == {"worker": "worker 101", "marks": {}, "admission": "open"}
    coordinator.state = {"marks": {"r7": 2}, "admission": "closed", "checkpoint_id": "step-3"}
    _, late = await coordinator.worker(102)
    assert late == {"worker": "worker 102", "marks": {"r7": 2}, "admission": "closed", "checkpoint_id": "step-3"}
    assert coordinator.roster.connected == ("worker 101", "worker 102")


async def test_workers_not_registered_block_readiness(coordinator: Coordinator) -> None:
    report = coordinator.roster.readiness("c1")
    assert list(report.worker_blockers) == [f"worker not registered (0 of 3), #{i}" for i in (1, 2, 3)]
    await coordinator.worker(101)
    await coordinator.worker(102)
    assert list(coordinator.roster.readiness("c1").worker_blockers) == ["worker not registered (2 of 3), #1"]
    await coordinator.worker(103)
    report = coordinator.roster.readiness("c1")
    assert list(report.worker_blockers) == []
    assert report.counts == {"workers": 3}


async def test_a_worker_lost_during_a_checkpoint_blocks_it_for_good(coordinator: Coordinator) -> None:
    for pid in (101, 102, 103):
        await coordinator.worker(pid)
    coordinator.roster.begin("c1")
    await coordinator.workers[1].aclose()  # worker 102 goes away mid-checkpoint
    await coordinator.until(lambda: "worker 102" in coordinator.roster.left)
    assert coordinator.roster.lost_during("c1") == ("worker 102",)
    await coordinator.worker(104)  # its replacement never saw admission close for c1
    assert list(coordinator.roster.readiness("c1").worker_blockers) == ["worker 102 disconnected during c1"]
    coordinator.roster.end("c1")
    assert coordinator.roster.lost_during("c1") == ()
    # The next checkpoint is not blocked by it, but the server remembers a worker left (restore refusal).
    assert list(coordinator.roster.readiness("c2").worker_blockers) == []
    assert coordinator.roster.left == ("worker 102",)


async def test_a_worker_lost_while_idle_blocks_only_until_replaced(coordinator: Coordinator) -> None:
    for pid in (101, 102, 103):
        await coordinator.worker(pid)
    await coordinator.workers[0].aclose()
    await coordinator.until(lambda: coordinator.roster.left == ("worker 101",))
    assert list(coordinator.roster.readiness("c1").worker_blockers) == ["worker not registered (2 of 3), #1"]
    await coordinator.worker(104)
    assert list(coordinator.roster.readiness("c1").worker_blockers) == []
    assert coordinator.roster.lost_during("c1") == ()


async def test_a_bad_or_duplicate_registration_is_refused(coordinator: Coordinator) -> None:
    await coordinator.worker(101)
    with pytest.raises(LinkRemoteError, match="worker 101 is already registered"):
        await coordinator.worker(101)
    for bad in ({"pid": "101"}, {"pid": 0}, {"pid": True}, ["pid", 5], None):
        link = await connect(coordinator.path, timeout=TIMEOUT)
        coordinator.workers.append(link)
        with pytest.raises(LinkRemoteError, match="positive integer pid"):
            await link.call(REGISTER_OP, bad, timeout=TIMEOUT)
    assert coordinator.roster.connected == ("worker 101",)


async def test_a_broadcast_names_each_worker_that_fails_and_never_hangs(coordinator: Coordinator) -> None:
    await coordinator.worker(101, handler=_answer_ready)
    await coordinator.worker(102, handler=_never_answer)
    gone, _ = await coordinator.worker(103, handler=_answer_ready)
    answers = await coordinator.roster.broadcast("ready", {"checkpoint_id": "c1"}, timeout=0.5)
    assert answers.replies == {
        "worker 101": {"op": "ready", "ready": True},
        "worker 103": {"op": "ready", "ready": True},
    }
    assert set(answers.failures) == {"worker 102"}
    assert isinstance(answers.failures["worker 102"], LinkTimeout)
    assert not answers.complete
    await gone.aclose()
    await coordinator.until(lambda: "worker 103" in coordinator.roster.left)
    answers = await coordinator.roster.broadcast("ready", None, timeout=0.5)
    assert set(answers.replies) == {"worker 101"}
    assert isinstance(answers.failures["worker 102"], LinkTimeout)


async def test_a_broadcast_to_a_worker_disconnecting_mid_call_is_a_link_closed(coordinator: Coordinator) -> None:
    closing: list[asyncio.Future[None]] = []

    async def _hang_up(link: Link, _op: str, _body: Any) -> Any:
        closing.append(asyncio.ensure_future(link.aclose()))  # the worker exits while handling the call
        await asyncio.Event().wait()

    await coordinator.worker(101, handler=_hang_up)
    answers = await coordinator.roster.broadcast("close_admission", {"checkpoint_id": "c1"}, timeout=30.0)
    assert isinstance(answers.failures["worker 101"], LinkClosed)
    await asyncio.gather(*closing)


async def test_expected_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        Roster(0)
