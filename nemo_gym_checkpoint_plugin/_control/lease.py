"""The lease: how long a participant keeps a checkpoint open without hearing from its controller.

Every accepted control call extends it to ``policy.expires_at(deadline_ts)`` (it never
shrinks). When it expires the participant resumes on its own; a failed self-resume is
retried every ``policy.retry_seconds`` until one succeeds or a controller call ends
the checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from nemo_gym_checkpoint_plugin._markers import hookimpl

from .._types import LeasePolicy

__all__ = ["Lease", "DefaultLeasePolicy"]

logger = logging.getLogger(__name__)


class Lease:
    """One participant's lease. ``on_expiry`` is the self-resume; it must end with ``clear()``."""

    def __init__(
        self,
        policy: LeasePolicy,
        on_expiry: Callable[[], Awaitable[None]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.policy = policy
        self._on_expiry = on_expiry
        self._clock = clock
        self.expires_at: float | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.self_resumes = 0
        self.failed_self_resumes = 0

    def extend(self, deadline_ts: float) -> float:
        candidate = self.policy.expires_at(deadline_ts)
        if self.expires_at is None or candidate > self.expires_at:
            self.expires_at = candidate
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch(), name="checkpoint-lease")
        return self.expires_at

    def clear(self) -> None:
        self.expires_at = None
        # The self-resume runs in the watcher and clears the lease: it must not cancel itself, and
        # stays referenced so an extension meanwhile is watched by it rather than by a second watcher.
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()
            self._watcher = None

    async def _watch(self) -> None:
        while True:
            expires_at = self.expires_at
            if expires_at is None:
                return
            remaining = expires_at - self._clock()
            if remaining > 0:
                # wait-ok: the lease is a point in time; a later extension is noticed when this wakes.
                await asyncio.sleep(remaining)
                continue
            self.self_resumes += 1
            try:
                await self._on_expiry()
            except Exception:
                self.failed_self_resumes += 1
                logger.exception(
                    "checkpoint lease expired and the self-resume failed; retrying in %ss", self.policy.retry_seconds
                )
                # wait-ok: docs/protocol.md's retry interval after a failed self-resume.
                await asyncio.sleep(self.policy.retry_seconds)
                continue
            if self.expires_at == expires_at:
                # The self-resume found nothing to end (a controller resumed meanwhile): nothing left to watch.
                self.expires_at = None


class DefaultLeasePolicy:
    """Core plugin answering ``lease_policy``: ``deadline_ts + lease_grace_seconds``, retry every 30 s."""

    @hookimpl(trylast=True)
    def lease_policy(self, settings: object) -> LeasePolicy:
        return LeasePolicy(grace_seconds=float(getattr(settings, "lease_grace_seconds", 600.0)))
