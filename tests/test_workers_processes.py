"""Real worker processes against a coordinator: SIGKILL of one mid-prepare, one lost after readiness, restore after.

The coordinator and the main process's plane run in the test's event loop; each worker is a
child Python process (``workers_child.py``) running the worker side against a trivial
participant. Nothing is simulated: the children register over the Unix socket, and a SIGKILL
closes the link the way a crashed uvicorn worker does.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from control_support import deadline
from workers_support import Cluster

from nemo_gym_checkpoint_plugin._errors import ExportFailed, InvalidPhase
from nemo_gym_checkpoint_plugin._identity import episode_id

pytestmark = pytest.mark.slow

CHILD = Path(__file__).with_name("workers_child.py")
STARTUP = 60.0  # a child imports the plugin before it registers


class Children:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), self.cluster.path, str(self.cluster.directory)],
            stdout=subprocess.DEVNULL,
            cwd=CHILD.parent,
        )
        self.procs.append(proc)
        return proc

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        roster = self.cluster.coordinator.roster
        try:
            async with asyncio.timeout(STARTUP):
                while not condition():
                    await roster.changed(1.0)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}: connected {roster.connected}") from None

    async def registered(self, count: int) -> None:
        await self.until(lambda: len(self.cluster.coordinator.roster.connected) == count, f"{count} workers")

    async def kill(self, proc: subprocess.Popen[bytes]) -> str:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        name = f"worker {proc.pid}"
        await self.until(lambda: name in self.cluster.coordinator.roster.left, f"{name} to leave")
        return name

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
async def children() -> AsyncIterator[Children]:
    cluster = Cluster(3, call_timeout=5.0, work_timeout=10.0)
    await cluster.start()
    made = Children(cluster)
    try:
        yield made
    finally:
        made.stop()
        await cluster.aclose()


async def test_sigkill_mid_prepare_then_lost_after_readiness_then_restore(children: Children, tmp_path: Path) -> None:
    plane = children.cluster.plane
    first = [children.spawn() for _ in range(3)]
    await children.registered(3)

    # Mid-prepare: every worker still has a step running.
    reply = await plane.prepare("c1", deadline(1.0))
    assert reply["phase"] == "preparing"
    assert reply["report"]["blockers"] == sorted(f"held-{proc.pid}" for proc in first)
    killed = await children.kill(first[1])
    (children.cluster.directory / "go").touch()  # the steps of the others finish
    reply = await plane.prepare("c1", deadline(1.0))
    assert reply["phase"] == "preparing", reply
    assert reply["report"]["blockers"] == []
    assert f"{killed} disconnected during c1" in reply["report"]["worker_blockers"]
    await plane.resume("c1", deadline())

    # Its replacement registers; a new checkpoint becomes ready with every worker.
    replacement = children.spawn()
    await children.registered(3)
    reply = await plane.prepare("c2", deadline(20.0))
    assert reply["phase"] == "prepared", reply
    assert reply["report"]["counts"] == {"workers": 3, "ready_workers": 3}

    # A worker lost between readiness and export: the commit fails, final for the id.
    await children.kill(replacement)
    with pytest.raises(ExportFailed):
        await plane.commit("c2", deadline(), str(tmp_path), None)
    with pytest.raises(ExportFailed):
        await plane.commit("c2", deadline(), str(tmp_path), None)
    assert not list(tmp_path.rglob("manifest.json"))
    await plane.resume("c2", deadline())

    # Workers left this server: a restore is refused before it marks anything, even with a fresh replacement.
    children.spawn()
    await children.registered(3)
    with pytest.raises(InvalidPhase, match="left"):
        await plane.restore("r1", deadline(), str(tmp_path), [episode_id("e1", 0)])
    assert len(plane.marks) == 0
