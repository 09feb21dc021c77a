"""``collect`` owns the deployment for its whole run (docs/protocol.md, "One controller per deployment").

- ``take_deployment``: before any restore or dispatch, the collector claims every participant under
  its owner id (``collect-<run>@<host>``). A deployment another controller owns refuses it: the
  collector then stops (exit 2) naming the owner, unless ``--take-over`` says to fence it, or the
  owner is the dead collector whose directory lock this one took over (it is gone: fenced at once,
  with a message);
- ``OwnerKeeper``: renews the claim while the collection runs (every checkpoint call renews it too);
  a renewal refused ``owner_fenced`` means another controller took the deployment over: the
  collection stops (``on_fenced``), it never fights for it;
- ``resume_left_open``: once it owns the deployment, a checkpoint or restore a dead controller left
  open (phase ``preparing``, ``prepared``, ``committed`` or ``restored``: its admission closed, every
  row parked until its lease would expire) is resumed, under its own checkpoint id, before this run
  restores or dispatches anything;
- ``give_back``: releases the deployment at the end (what fails is only logged: the lease ends anyway).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from ..coordination import CoordinationError, Coordinator
from ..coordination._ownership import OWNER_CONFLICT, OWNER_FENCED, holders
from ._where import UsageError

__all__ = ["OwnerKeeper", "give_back", "resume_left_open", "take_deployment"]

logger = logging.getLogger(__name__)

# Seconds between renewals at most (the lease lasts the call's deadline plus lease_grace_seconds).
RENEW_EVERY = 60.0


async def take_deployment(
    coordinator: Coordinator,
    owner: str,
    *,
    take_over: bool,
    predecessor: str | None,
    say: Callable[[str], None],
    timeout: float,
) -> None:
    """Own every participant as ``owner``; ``UsageError`` naming the owner when another live controller has it."""
    try:
        await coordinator.claim(owner, timeout=timeout)
        return
    except CoordinationError as exc:
        if any(f.code != OWNER_CONFLICT for f in exc.failures):
            raise
    statuses, _failures = await coordinator.status(timeout=timeout)
    owners = holders(statuses)
    others = sorted(set(owners) - {owner, predecessor})
    if others and not take_over:
        # The participants nobody owned accepted this claim: give them back before refusing.
        coordinator.owner = owner
        await give_back(coordinator, timeout)
        named = "; ".join(f"{who} ({len(owners[who])} of {len(statuses)} servers)" for who in others)
        raise UsageError(
            f"the deployment is owned by another controller: {named}; one controller per deployment. "
            "Wait for it to end, or pass --take-over to fence it for good (only when it is gone or "
            "must stop)"
        )
    fenced = others + ([predecessor] if predecessor in owners else [])
    say(
        f"taking the deployment over from {', '.join(fenced)} ("
        + ("--take-over" if others else "the collector whose lock this one took over is gone")
        + "): it is fenced for good"
    )
    await coordinator.claim(owner, take_over=True, timeout=timeout)


async def resume_left_open(coordinator: Coordinator, say: Callable[[str], None], timeout: float) -> list[str]:
    """Resume every checkpoint or restore left open on the deployment; returns their ids."""
    statuses, failures = await coordinator.status(timeout=timeout)
    if failures:
        raise CoordinationError("status", failures)
    left: dict[str, list[str]] = {}
    for name, status in sorted(statuses.items()):
        checkpoint_id = status.get("checkpoint_id")
        if status.get("phase") != "idle" and isinstance(checkpoint_id, str):
            left.setdefault(checkpoint_id, []).append(f"{name} {status.get('phase')}")
    for checkpoint_id, where in left.items():
        say(f"{checkpoint_id} was left open ({', '.join(where)}): resuming it before this run restores or dispatches")
        await coordinator.resume(checkpoint_id, timeout=timeout)
    return list(left)


class OwnerKeeper:
    """Renews the ownership every ``every`` seconds until ``stop``; ``on_fenced(detail)`` once taken over."""

    def __init__(
        self, coordinator: Coordinator, owner: str, every: float, timeout: float, on_fenced: Callable[[str], Any]
    ) -> None:
        self.coordinator = coordinator
        self.owner = owner
        self.every = min(every, RENEW_EVERY)
        self.timeout = timeout
        self.on_fenced = on_fenced
        self.fenced: str | None = None
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=self.every)
            except TimeoutError:
                pass
            if self._stop.is_set():
                return
            try:
                await self.coordinator.claim(self.owner, timeout=self.timeout)
            except CoordinationError as exc:
                refused = [f for f in exc.failures if f.code in (OWNER_FENCED, OWNER_CONFLICT)]
                if refused:
                    self.fenced = refused[0].detail
                    self.on_fenced(self.fenced)
                    return
                # A server down or slow: the lease outlasts a missed renewal; the next one retries.
                logger.warning("renewing the deployment's ownership failed (retried): %s", exc)


async def give_back(coordinator: Coordinator, timeout: float) -> None:
    try:
        await coordinator.release(timeout=timeout)
    except CoordinationError as exc:
        logger.warning("releasing the deployment failed (its lease ends on its own): %s", exc)
