"""Freeze the inference workers' generations in place while a checkpoint is open (vLLM's dev-mode pause).

docs/protocol.md, "Generation cuts". When a prepare finds cuttable generations running, the model
server asks each of its workers that serves vLLM's dev-mode routes (``VLLM_SERVER_DEV_MODE=1``:
``GET /is_paused`` answers) to ``POST /pause?mode=keep&clear_cache=false``: requests stay where
they are, KV cache kept. The cuts the commit exports are then where the generations stand, and
without a crash ``POST /resume`` (at the checkpoint's resume) lets them go on: nothing is
generated twice. A worker that does not serve the routes is simply not frozen (its cut is where
its stream stood at the export).

Freezing is bounded: it gets ``FREEZE_SHARE`` of the time left to the prepare's deadline (at most
``MAX_FREEZE_SECONDS``), so a worker whose pause hangs never delays ``prepared`` past that share
and the later stages keep the rest. A worker asked to pause is resumed at the end of the
checkpoint whatever the pause answered (it may have paused all the same), retried a few times;
a restore resumes every worker too (a crashed model server may have left one paused).

The pause is worker-wide: every model server sharing a worker sees it (the controller
checkpoints them together).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["FREEZE_SHARE", "MAX_FREEZE_SECONDS", "WorkerFreeze"]

logger = logging.getLogger(__name__)

FREEZE_SHARE = 0.25
MAX_FREEZE_SECONDS = 10.0
_RESUME_ATTEMPTS = 5
_RESUME_TIMEOUT_SECONDS = 10.0
_RESUME_BACKOFF_SECONDS = 1.0


def _root(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1")


class WorkerFreeze:
    """The dev-mode pause of the workers behind one model server's clients (used from its event loop)."""

    def __init__(self, clients: Callable[[], Iterable[Any]]) -> None:
        # The server's current worker clients (vllm_model rebinds them when its endpoint file changes).
        self._current_clients = clients
        self.supported: dict[str, bool] = {}  # per worker root, once a probe answered
        self._asked: set[str] = set()  # roots asked to pause and not resumed since
        self.task: asyncio.Task[None] | None = None
        self.last_seconds: float | None = None
        self.timeouts_total = 0
        self.failures_total = 0
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def _clients(self) -> dict[str, Any]:
        # One client per worker root: Gym's own transport (auth headers, connection pool).
        return {_root(client.base_url): client for client in self._current_clients()}

    @property
    def frozen(self) -> bool:
        return bool(self._asked)

    @property
    def freezing(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self, deadline_ts: float) -> None:
        """Freeze every worker within this prepare's share of ``deadline_ts`` (in a task readiness waits for)."""
        budget = min(MAX_FREEZE_SECONDS, FREEZE_SHARE * max(0.0, deadline_ts - time.time()))
        self.task = asyncio.ensure_future(self._freeze(budget))

    async def _freeze(self, budget: float) -> None:
        started = time.monotonic()
        try:
            async with asyncio.timeout(budget):
                await asyncio.gather(*(self._pause(root, client) for root, client in self._clients.items()))
        except TimeoutError:
            self.timeouts_total += 1
            logger.warning(
                "generation cuts: freezing the workers took longer than %.2fs (this prepare's share of its "
                "deadline); the cuts are taken where the streams stand",
                budget,
            )
        finally:
            self.last_seconds = time.monotonic() - started

    async def _pause(self, root: str, client: Any) -> None:
        try:
            if root not in self.supported:
                status, _ = await _call(client, "GET", f"{root}/is_paused")
                if status in (404, 405):
                    self.supported[root] = False
                elif 200 <= status < 300:
                    self.supported[root] = True
            if not self.supported.get(root):
                return
            self._asked.add(root)  # before the call: a pause that times out may still take effect
            status, body = await _call(client, "POST", f"{root}/pause", params={"mode": "keep", "clear_cache": "false"})
            if not 200 <= status < 300:
                self.failures_total += 1
                logger.warning("generation cuts: %s refused to pause (%s): %s", root, status, body[:200])
        except Exception as exc:  # a worker that cannot be frozen is cut where its stream stands
            self.failures_total += 1
            logger.warning("generation cuts: could not pause %s: %s: %s", root, type(exc).__name__, exc)

    def thaw(self) -> None:
        """The checkpoint ended: stop freezing, resume every worker asked to pause (in the background, retried)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.task = None
        roots, self._asked = sorted(self._asked), set()
        for root in roots:
            self._spawn(self._resume(root))

    async def resume_all(self) -> None:
        """Resume every worker that serves the routes (a restore: a dead model server may have left one paused)."""
        roots = [root for root in self._clients if self.supported.get(root, True)]
        await asyncio.gather(*(self._resume(root, attempts=1) for root in roots))

    async def _resume(self, root: str, attempts: int = _RESUME_ATTEMPTS) -> None:
        client = self._clients.get(root)
        if client is None:
            return  # no longer one of this server's workers
        for attempt in range(1, attempts + 1):
            try:
                async with asyncio.timeout(_RESUME_TIMEOUT_SECONDS):
                    status, body = await _call(client, "POST", f"{root}/resume")
                if 200 <= status < 300 or status in (404, 405):
                    return
                reason = f"status {status}: {body[:200]!r}"
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}"
            if attempt < attempts:
                # Between attempts at a worker that did not answer: a retry interval, not a condition.
                await asyncio.sleep(_RESUME_BACKOFF_SECONDS * attempt)  # wait-ok: retry backoff
        self.failures_total += 1
        logger.error(
            "generation cuts: could not resume %s after %d attempts (%s); its generations stay frozen "
            "until it is resumed (POST %s/resume)",
            root,
            attempts,
            reason,
            root,
        )

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _call(client: Any, method: str, url: str, **kwargs: Any) -> tuple[int, bytes]:
    response = await client._request(method=method, url=url, **kwargs)  # Gym's NeMoGymAsyncOpenAI transport (0.7.x)
    try:
        return response.status, await response.read()
    finally:
        response.release()
