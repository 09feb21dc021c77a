"""One uvicorn worker's app of a server with several workers: its gate, its claims, its forwarded control.

``attach_worker`` is what ``_attach.attach_checkpointing`` does in a worker process (Gym sets
``IS_NEMO_GYM_FASTAPI_WORKER`` before uvicorn spawns them). The worker's plugin manager holds
the server's participants (built-ins and the entry-point group, joined through ``attach`` as on
a single worker); there is no ``ControlPlane`` here. Instead a ``Worker`` (``worker.py``) holds
what this worker's admission gate reads and answers the coordinator's calls. On the app:

- every plugin's ``serving`` middleware with the worker's marks; on resources servers the seed
  replies' hook;
- outermost, one ``WorkerFront`` (``front.py``) running in order: control routes forwarded to the
  coordinator (``forward.py``); on environments, the explicit ``"<id>-aN"`` decoding (outside the
  gate, as on one worker); the admission gate over the worker's ``admission`` and ``marks``;
  ``ClaimRestored``, inside the gate: a request of a replacement attempt whose restored record
  the coordinator holds claims it first (installed here, one owner: a second worker's claim is
  refused ``attempt_running``, as the reply says). On a model server the calls of one episode land
  on any worker and what a claim installs (Gym's capture rows) is in the directory every worker
  shares: a call whose replacement another worker claimed goes on.

The worker registers with the coordinator at the app's startup (the socket's path is in
``SOCKET_ENV``): a worker that cannot register fails its startup, and uvicorn then stops the
server rather than serve a worker no checkpoint would see. When its link to the coordinator
closes (the main process is gone) the worker stops itself with SIGTERM: nothing could
checkpoint what it holds any more.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

from .front import ClaimRestored, WorkerFront
from .service import SOCKET_ENV
from .worker import Worker

__all__ = ["ClaimRestored", "WorkerAttachment", "attach_worker"]

logger = logging.getLogger(__name__)


def _relay_closes(app: Any, worker: Worker) -> None:
    """A ``/close_session`` this worker answered 2xx is relayed to the other workers (``messages.SESSION_CLOSED``).

    Gym's server drops a session's binding in the worker that answered the close only; the one
    that seeded it would keep exporting it.
    """
    from nemo_gym_checkpoint_plugin._seeds import seeded_episode
    from nemo_gym_checkpoint_plugin.builtin_participants.shared.reply_headers import ReplyHeaders

    async def on_close(body: bytes, status: int) -> dict[str, str]:
        found = seeded_episode(body) if 200 <= status < 300 else None
        session_id = found[1].get("resources_session_id") if found is not None else None
        if found is not None and isinstance(session_id, str):
            worker.report_session_closed(session_id, found[0])
        return {}

    app.add_middleware(ReplyHeaders, path="/close_session", headers_for=on_close)


@dataclass
class WorkerAttachment:
    """What ``attach_worker`` installed in one worker (kept on the attachment)."""

    worker: Worker
    gate_counters: Any
    socket_path: str


def attach_worker(app: Any, pm: Any, *, kind: str, call_timeout: float = 10.0) -> WorkerAttachment:
    """Install the worker side on ``app`` (module docstring); ``RuntimeError`` when no coordinator is named."""
    socket_path = os.environ.get(SOCKET_ENV)
    if not socket_path:
        raise RuntimeError(
            f"this uvicorn worker finds no checkpoint coordinator ({SOCKET_ENV} is not set): the main process "
            "of a server with num_workers > 1 must run the plugin too"
        )
    worker = Worker(pm, call_timeout=call_timeout)
    pm.hook.serving(app=app, marks=worker.marks)
    if kind == "resources":
        from nemo_gym_checkpoint_plugin._seeds import install_seed_hook

        install_seed_hook(app, worker.participants)
        _relay_closes(app, worker)
    if getattr(app.state, "ng_checkpoint_gate", None) is not None:
        raise RuntimeError("the admission gate is already installed on this app")
    # Outermost: the front sees the raw prefixed path before any Gym middleware (as install_gate's gate).
    app.add_middleware(
        WorkerFront,
        worker=worker,
        counters=worker.gate,
        run_path="/run" if kind == "environment" else None,
        explicit_ids=kind == "environment",
        shared_claims=kind == "model",
    )
    app.state.ng_checkpoint_gate = worker.gate

    stopping = False

    async def start() -> None:
        await worker.start(socket_path)
        logger.info("checkpoint %s registered with its coordinator", worker.name)
        assert worker.link is not None

        def lost(_link: Any) -> None:
            if not stopping:
                logger.error("checkpoint %s lost its coordinator (%s); stopping", worker.name, _link.close_reason)
                os.kill(os.getpid(), signal.SIGTERM)

        worker.link.on_close(lost)

    async def stop() -> None:
        nonlocal stopping
        stopping = True
        await worker.aclose()

    app.router.on_startup.append(start)
    app.router.on_shutdown.append(stop)
    return WorkerAttachment(worker=worker, gate_counters=worker.gate, socket_path=socket_path)
