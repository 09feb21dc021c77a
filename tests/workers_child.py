"""A worker process for the real-process tests: the worker side of ``_workers/worker.py`` and a trivial participant.

``python workers_child.py <socket> <directory>``: registers with its own pid, prints
``registered worker <pid>`` and serves the coordinator's calls until the link closes. While
``<directory>/go`` does not exist its readiness names one blocker, ``held-<pid>`` (a step still
running), so a test can catch it mid-prepare; its export is one record, ``w<pid>``.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from nemo_gym_checkpoint_plugin._markers import hookimpl
from nemo_gym_checkpoint_plugin._plugins import make_plugin_manager
from nemo_gym_checkpoint_plugin._types import Readiness
from nemo_gym_checkpoint_plugin._workers.worker import Worker


class FileParticipant:
    def __init__(self, directory: Path) -> None:
        self.go = directory / "go"

    @hookimpl
    def ready(self, checkpoint_id: str | None) -> Readiness:
        if checkpoint_id is not None and not self.go.exists():
            return Readiness(blockers=[f"held-{os.getpid()}"])
        return Readiness(counts={"ready_workers": 1})

    @hookimpl
    def export(self, checkpoint_id: str, scope: frozenset[str] | None) -> list[dict[str, Any]]:
        return [{"episode_id": {"rollout_id": f"w{os.getpid()}", "attempt": 0}, "pid": os.getpid()}]


async def main(path: str, directory: Path) -> None:
    worker = Worker(make_plugin_manager([FileParticipant(directory)], load_entry_points=False), call_timeout=10.0)
    await worker.start(path)
    print(f"registered {worker.name}", flush=True)
    await worker.wait_closed()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
