"""``gate_overhead.py --workers N``: both variants served by N uvicorn workers behind one port.

Each variant is one server process run the way Gym runs a server with ``num_workers: N``:
uvicorn's supervisor (``uvicorn.supervisors.Multiprocess``, what ``uvicorn.run(workers=N)``
starts) owns the listening socket, spawns N workers and supervises them; each worker imports
the app by its import string (``gate_overhead:gated_worker_app`` or ``plain_worker_app``,
uvicorn factories) and serves the shared port. The gated one is a checkpointed server with
several workers (docs/protocol.md section 9a): before uvicorn starts, the supervisor's process
starts the coordinator exactly as ``_attach._attach_coordinator`` does
(``_workers.service.start_coordinator``: its thread, the one ``ControlPlane`` and the workers'
socket named in the environment the workers inherit), and each worker installs the worker side
exactly as ``_attach.attach_checkpointing`` does in a worker (``_workers.attach.attach_worker``:
restored-record claims, the gate over the worker's admission and marks, the environment's
explicit attempt ids, control routes forwarded to the coordinator), registering at its startup.

The retired marks of other rollouts reach the workers the real way: a ``retire`` control call on
the shared port, forwarded by whichever worker gets it to the coordinator, which marks every
worker (and gives the marks to a worker registering later). Before measuring, the parent waits
until N distinct worker pids answered and, for the gated one, the coordinator's ``status`` names
N connected workers.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

import aiohttp

__all__ = ["TOKEN_ENV", "retire_others", "serve_workers", "wait_workers"]

# The bearer token of the gated variant's control routes (the parent picks it, the server reads it).
TOKEN_ENV = "NG_BENCH_GATE_TOKEN"
CONTROL = "/ng-control/v1/checkpoint"
# uvicorn kills a worker that has not answered its health ping in time; workers import FastAPI and the
# plugin on 2 shared cores (Gym's deployments in this project use 300 s too).
HEALTHCHECK_SECONDS = 300


def serve_workers(gated: bool, workers: int) -> None:
    """Child process: bind a free loopback port, report it on stdout, run uvicorn's supervisor until stopped."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.set_inheritable(True)
    if gated:
        from nemo_gym_checkpoint_plugin._settings import CheckpointSettings
        from nemo_gym_checkpoint_plugin._workers.service import start_coordinator

        token = os.environ[TOKEN_ENV]
        settings = CheckpointSettings(enabled=True, control_auth_token_env=TOKEN_ENV)
        # As in Gym's main process (_attach._attach_coordinator): the coordinator, then uvicorn.
        start_coordinator(expected=workers, kind="environment", instance="bench", settings=settings, token=token)
    app = "gate_overhead:gated_worker_app" if gated else "gate_overhead:plain_worker_app"
    config = uvicorn.Config(
        app,
        factory=True,
        workers=workers,
        log_level="warning",
        access_log=False,
        timeout_worker_healthcheck=HEALTHCHECK_SECONDS,
    )
    print(sock.getsockname()[1], flush=True)
    Multiprocess(config, sockets=[sock]).run()


async def wait_workers(base: str, workers: int, gated: bool, token: str, timeout: float = 300.0) -> list[int]:
    """Return the pids of the ``workers`` workers serving ``base`` once each answered (and registered, if gated).

    Each ``/pid`` request goes on a new connection, so the kernel hands it to any worker accepting.
    """
    deadline = time.monotonic() + timeout
    pids: set[int] = set()
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        while True:
            try:
                async with session.get(f"{base}/pid") as reply:
                    if reply.status == 200:
                        pids.add(int((await reply.json())["pid"]))
                connected = workers
                if gated and len(pids) >= workers:
                    headers = {"Authorization": f"Bearer {token}"}
                    async with session.get(f"{base}{CONTROL}/status", headers=headers) as reply:
                        connected = len((await reply.json())["workers"]["connected"])
                if len(pids) >= workers and connected == workers:
                    return sorted(pids)
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{base}: {len(pids)} of {workers} workers answered within {timeout}s")
            await asyncio.sleep(0.02)  # wait-ok: poll interval while the workers start (bounded)


async def retire_others(base: str, token: str, rollouts: int) -> dict[str, Any]:
    """Retire attempt 1 of ``retired-0`` .. ``retired-<rollouts-1>`` through the shared port; the plane's reply."""
    body = {
        "checkpoint_id": "bench-retire",
        "deadline_ts": time.time() + 60,
        "episode_ids": [{"rollout_id": f"retired-{index}", "attempt": 1} for index in range(rollouts)],
    }
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}{CONTROL}/retire", json=body, headers=headers) as reply:
            answer: dict[str, Any] = await reply.json(content_type=None)
            if reply.status != 200:
                raise RuntimeError(f"retire through the shared port: {reply.status} {answer}")
            return answer
