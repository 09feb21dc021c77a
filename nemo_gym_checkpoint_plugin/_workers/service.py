"""The coordinator in a server's main process: its own event loop thread beside uvicorn's supervisor.

With ``num_workers > 1`` Gym's ``run_webserver`` builds the server and its app in the main
process, then hands uvicorn an import string: uvicorn binds the port, spawns the workers (each
imports the entrypoint module and builds its own app) and supervises them from the main thread,
never serving the main process's app. ``start_coordinator`` (called by the attachment while that
app is built, before uvicorn starts) therefore runs the participant apart from it:

- it creates the runtime directory (``runtime_dir.py``: under ``/tmp``, 0700, removed at exit)
  and starts a daemon thread with its own event loop;
- on that loop it builds the one ``ControlPlane`` of the server, whose plugin manager holds the
  coordinator's participant (``fanout.py``) and no other participant (the core plugins, storage
  backends and lease policy, stay; third-party participant plugins run in the workers only),
  the control routes' ASGI app over that plane (``_routes.attach``: the forwarded requests run
  through it, ``forward.py``), its metrics reading the workers' gates (``gates.py``), and serves
  the coordinator's socket;
- it puts the socket's path in the environment (``SOCKET_ENV``), which uvicorn's spawned workers
  inherit, and returns once the socket listens (or raises what failed).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from .coordinator import Coordinator
from .runtime_dir import RuntimeDir, create_runtime_dir

__all__ = ["SOCKET_ENV", "CoordinatorService", "main_plugin_manager", "start_coordinator"]

logger = logging.getLogger(__name__)

# Where a worker finds its coordinator's socket (set by the main process before uvicorn spawns workers).
SOCKET_ENV = "NG_CHECKPOINT_COORDINATOR_SOCKET"
_START_SECONDS = 30.0


def main_plugin_manager(participant: Any) -> Any:
    """A manager with the core plugins, the entry-point group's non-participant plugins and ``participant``.

    A third-party plugin implementing any participant hook is unregistered here: it is a participant
    plugin, and participants run in the workers (the coordinator relays their records).
    """
    from nemo_gym_checkpoint_plugin._plugins import make_plugin_manager
    from nemo_gym_checkpoint_plugin.hookspecs import participant as participant_specs

    pm = make_plugin_manager([participant])
    participant_hooks = {name for name in vars(participant_specs) if getattr(pm.hook, name, None) is not None}
    for name in sorted(pm.third_party_names):
        plugin = pm.get_plugin(name)
        if any(hasattr(plugin, hook) for hook in participant_hooks):
            pm.unregister(name=name)
    return pm


@dataclass
class CoordinatorService:
    """The running coordinator: its thread and loop, its plane and the socket path the workers connect to."""

    runtime: RuntimeDir
    socket_path: str
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    coordinator: Coordinator
    plane: Any
    extras: dict[str, Any] = field(default_factory=dict)

    def call(self, coro: Any, timeout: float = _START_SECONDS) -> Any:
        """Run ``coro`` on the coordinator's loop from another thread and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


def start_coordinator(
    *, expected: int, kind: str, instance: str, settings: Any, token: str, call_timeout: float = 10.0
) -> CoordinatorService:
    """Start the coordinator of a server with ``expected`` workers (module docstring); raise what failed."""
    runtime = create_runtime_dir()
    socket_path = runtime.socket_path("coordinator.sock")
    loop = asyncio.new_event_loop()
    started: Future[tuple[Coordinator, Any]] = Future()

    async def build() -> tuple[Coordinator, Any]:
        from fastapi import FastAPI

        from nemo_gym_checkpoint_plugin._control import ControlPlane
        from nemo_gym_checkpoint_plugin._routes import attach as attach_routes

        coordinator = Coordinator(expected, call_timeout=call_timeout)
        plane = ControlPlane(
            main_plugin_manager(coordinator.participant), kind=kind, instance=instance, settings=settings
        )
        coordinator.bind(plane.admission, plane.marks)
        coordinator.watch_metrics(plane.telemetry.metrics)
        control_app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        attach_routes(control_app, plane, token)
        coordinator.control_app = control_app
        await coordinator.serve(socket_path)
        return coordinator, plane

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            built = loop.run_until_complete(build())
        except BaseException as exc:
            started.set_exception(exc)
            return
        started.set_result(built)
        loop.run_forever()

    thread = threading.Thread(target=run, name=f"ng-checkpoint-coordinator-{instance}", daemon=True)
    thread.start()
    try:
        coordinator, plane = started.result(_START_SECONDS)
    except BaseException:
        runtime.remove()
        raise
    os.environ[SOCKET_ENV] = socket_path
    logger.info("checkpoint coordinator of %s (%d workers) listens on %s", instance, expected, socket_path)
    return CoordinatorService(
        runtime=runtime,
        socket_path=socket_path,
        loop=loop,
        thread=thread,
        coordinator=coordinator,
        plane=plane,
    )
