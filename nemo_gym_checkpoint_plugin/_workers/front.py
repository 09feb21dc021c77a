"""A worker's front: control forwarding, explicit attempt ids, the admission gate and claims in one layer.

A uvicorn worker of a checkpointed server (``attach.py``) runs four steps in front of Gym's app, in
this order, each as it runs on its own:

1. ``ForwardControl``: a request under ``/ng-control/`` goes to the coordinator (``forward.py``);
2. on an environment, ``ExplicitAttemptIds``: a ``POST /run`` naming ``"<id>-aN"`` becomes attempt N
   of ``<id>`` (``_explicit_ids.py``);
3. the ``AdmissionGate`` over the worker's admission and marks (``_gate.py``);
4. ``ClaimRestored``: a replacement attempt's first request here claims its restored record.

``WorkerFront`` runs them as one pure ASGI middleware instead of four stacked ones: every data
request of a worker passes here, and each stacked layer cost a coroutine call and its own checks of
the scope (the gate-overhead benchmark with 4 workers, docs/performance.md). The decisions are
those of the four steps, taken by their own code (``forward_control``, ``decode_explicit``,
``AdmissionGate.admit``, ``ClaimRestored.claim_first``); only the calls between them are gone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

from nemo_gym_checkpoint_plugin._asgi import ASGIApp, Receive, Scope, Send
from nemo_gym_checkpoint_plugin._errors import AttemptRunning, CheckpointError
from nemo_gym_checkpoint_plugin._explicit_ids import decode_attributed, decode_explicit
from nemo_gym_checkpoint_plugin._gate import (
    RUN_ATTEMPT,
    AdmissionGate,
    GateCounters,
    attempt_from_path,
    is_exempt,
    run_body_attempt,
)
from nemo_gym_checkpoint_plugin._identity import episode_id

from .forward import forward_control, is_control_path

if TYPE_CHECKING:
    from .worker import Worker

__all__ = ["ClaimRestored", "WorkerFront"]

_UNREAD = object()  # a /run whose body no step parsed yet


class ClaimRestored:
    """Pure ASGI middleware: a replacement attempt's first request here claims its restored record first.

    Costs one ``len`` of an empty set per request unless a restore left records unclaimed.
    ``shared``: what a claim installs is visible to every worker (a model server's capture rows), so
    a request whose replacement another worker claimed goes on instead of being refused.
    """

    def __init__(self, app: ASGIApp, *, worker: Worker, run_path: str | None, shared: bool = False) -> None:
        self._app = app
        self._worker = worker
        self._run_path = run_path
        self._shared = shared

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._worker.restorable or scope["type"] != "http" or is_exempt(scope["path"]):
            await self._app(scope, receive, send)
            return
        claimed = await self.claim_first(scope, receive, send)
        if claimed is not None:
            await self._app(scope, claimed, send)

    async def claim_first(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """Claim the request's restored record if this worker's coordinator still holds it unclaimed.

        Returns the ``receive`` to hand on, or None when the claim was refused (answered here).
        """
        restorable = self._worker.restorable
        attempt = attempt_from_path(scope["path"])
        if attempt is None and scope["path"] == self._run_path and scope.get("method") == "POST":
            attempt, receive = await run_body_attempt(scope, receive)
        if attempt is not None:
            episode = episode_id(*attempt)
            if episode.capture_key in restorable:
                try:
                    await self._worker.claim(episode)
                except CheckpointError as error:
                    if not (self._shared and isinstance(error, AttemptRunning)):
                        await _reply_error(send, error)
                        return None
                    restorable.discard(episode.capture_key)  # installed by the worker that claimed it
        return receive


class WorkerFront:
    """Pure ASGI middleware: a worker's four front steps (module docstring) in one layer, in their order."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        worker: Worker,
        counters: GateCounters,
        run_path: str | None,
        explicit_ids: bool,
        shared_claims: bool,
    ) -> None:
        self._app = app
        self._worker = worker
        self._explicit_ids = explicit_ids
        self._run_path = run_path
        self._admission = worker.admission
        self._marks = worker.marks
        # The gate's and the claims' own code, called below instead of stacked (their ``app`` is never called).
        self._gate = AdmissionGate(
            app, admission=worker.admission, marks=worker.marks, counters=counters, run_path=run_path
        )
        self._claims = ClaimRestored(app, worker=worker, run_path=run_path, shared=shared_claims)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        path = scope["path"]
        if is_control_path(path):
            await forward_control(self._worker.link, scope, receive, send)
            return
        admission, marks = self._admission, self._marks
        if self._explicit_ids and path == "/run" and scope.get("method") == "POST":
            # While the gate will need the attempt, one parse serves the decoding and the gate.
            decode = decode_attributed if marks or not admission.is_open else decode_explicit
            decoded = await decode(scope, receive, send)
            if decoded is None:
                return
            scope, receive = decoded
        if (not admission.served or not admission.is_open or marks) and not is_exempt(path):
            if not admission.served:
                admission.served = True  # once per process: from the first data request on, no restore here
            if admission.is_open:
                if marks:
                    # Open with marks present: only a marked attempt is refused, nothing parks; the attempt
                    # is the path's or the one parsed above (else the gate's own path reads the body).
                    attempt = scope.get(RUN_ATTEMPT, _UNREAD) if path == self._run_path else attempt_from_path(path)
                    if attempt is _UNREAD:
                        admitted = await self._gate.admit(scope, receive, send)
                        if admitted is None:
                            return
                        receive = admitted
                    elif attempt is not None and marks.is_retired(*attempt):
                        await self._gate.refuse(send, attempt)
                        return
            else:
                admitted = await self._gate.admit(scope, receive, send)
                if admitted is None:
                    return
                receive = admitted
        if self._worker.restorable and not is_exempt(path):
            claimed = await self._claims.claim_first(scope, receive, send)
            if claimed is None:
                return
            receive = claimed
        await self._app(scope, receive, send)


async def _reply_error(send: Send, error: CheckpointError) -> None:
    body = orjson.dumps(error.to_body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
