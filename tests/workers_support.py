"""A server with several workers in one event loop: a main process's plane and coordinator, workers over real sockets.

``Cluster`` builds the main process's ``ControlPlane`` holding the coordinator's participant
(``_workers/fanout.py``), serves the coordinator on a Unix socket in a fresh directory under
``/tmp`` and starts workers (``_workers/worker.py``), each with its own in-test ``Participant``
(``control_support.py``) on its own plugin manager.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any

from control_support import Participant

from nemo_gym_checkpoint_plugin._control import ControlPlane
from nemo_gym_checkpoint_plugin._plugins import make_plugin_manager
from nemo_gym_checkpoint_plugin._workers.coordinator import Coordinator
from nemo_gym_checkpoint_plugin._workers.worker import Worker

TIMEOUT = 3.0


class Cluster:
    def __init__(self, expected: int, **coordinator: Any) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="ngw", dir="/tmp"))
        self.path = str(self.directory / "c.sock")
        options = {"call_timeout": TIMEOUT, "work_timeout": TIMEOUT, "poll_seconds": 0.2, **coordinator}
        self.coordinator = Coordinator(expected, **options)
        pm = make_plugin_manager([self.coordinator.participant], load_entry_points=False)
        self.plane = ControlPlane(pm, kind="environment", instance="env_one")
        self.coordinator.bind(self.plane.admission, self.plane.marks)
        self.workers: dict[int, Worker] = {}
        self.participants: dict[int, Participant] = {}

    async def start(self, *pids: int) -> None:
        await self.coordinator.serve(self.path)
        for pid in pids:
            await self.worker(pid)

    async def worker(self, pid: int, named: dict[str, Any] | None = None) -> Worker:
        """Start worker ``pid`` with its own ``Participant`` and the third-party plugins ``named``."""
        participant = Participant()
        pm = make_plugin_manager([participant], load_entry_points=False, named_plugins=named)
        worker = Worker(pm, pid=pid, call_timeout=TIMEOUT)
        await worker.start(self.path)
        self.workers[pid] = worker
        self.participants[pid] = participant
        return worker

    async def lose(self, pid: int) -> None:
        """Worker ``pid`` goes away (its link closes); return once the coordinator saw it leave."""
        await self.workers.pop(pid).aclose()
        async with asyncio.timeout(TIMEOUT):
            while f"worker {pid}" in self.coordinator.roster.connected:
                await self.coordinator.roster.changed(TIMEOUT)

    async def aclose(self) -> None:
        await self.plane.aclose()
        await asyncio.gather(*(worker.aclose() for worker in self.workers.values()))
        await self.coordinator.aclose()
        shutil.rmtree(self.directory, ignore_errors=True)
