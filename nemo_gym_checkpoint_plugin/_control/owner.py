"""One controller per deployment: the owner lease each participant keeps (docs/protocol.md, "Owner").

A controller names itself with an ``owner`` id in its control calls. The first ``prepare``,
``restore`` or ``owner`` call that names one while nobody owns the participant records it as the
**owner** until ``deadline_ts + lease_grace_seconds`` (every later call of the owner extends that,
like the checkpoint lease). While the owner's lease runs, every control call but ``status`` from
anyone else, a controller that sends no owner included, is refused ``owner_conflict`` naming the
owner: a second controller cannot prepare over a running collection, nor a stale one restore
into it. Ownership ends when the owner releases it (``owner`` with ``release``), or when its lease
expires. ``take_over`` (on ``prepare``, ``restore``, ``owner``) makes the caller the owner at once
and **fences** the one it replaces: every later call naming a fenced owner is ``owner_fenced``,
for good (the last 64 fenced owners are remembered). A participant nobody owns behaves exactly as
without owners: a controller that never sends one sees no change.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from .._errors import OwnerConflict, OwnerFenced
from .._types import LeasePolicy

__all__ = ["FENCED_MEMORY", "OwnerLease"]

logger = logging.getLogger(__name__)

FENCED_MEMORY = 64


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


class OwnerLease:
    """Who owns this participant, until when, and who was fenced. Synchronous: admit never awaits."""

    def __init__(self, policy: LeasePolicy, clock: Callable[[], float] = time.time) -> None:
        self.policy = policy
        self._clock = clock
        self._owner: str | None = None
        self._expires_at: float | None = None
        # Fenced owner -> the owner that took over from it.
        self._fenced: OrderedDict[str, str] = OrderedDict()

    @property
    def owner(self) -> str | None:
        """The owner while its lease runs (an expired lease is no owner)."""
        if self._owner is not None and self._expires_at is not None and self._expires_at <= self._clock():
            logger.warning(
                "the owner lease of %s expired at %s; the deployment has no owner", self._owner, _when(self._expires_at)
            )
            self._owner = self._expires_at = None
        return self._owner

    @property
    def expires_at(self) -> float | None:
        return self._expires_at if self.owner is not None else None

    def _record(self, owner: str, deadline_ts: float) -> None:
        expires = self.policy.expires_at(deadline_ts)
        if self._owner != owner or self._expires_at is None or expires > self._expires_at:
            self._expires_at = expires
        self._owner = owner

    def admit(
        self, owner: str | None, operation: str, deadline_ts: float, *, acquire: bool = False, take_over: bool = False
    ) -> None:
        """Let the call through (recording or extending ownership), or raise ``OwnerConflict``/``OwnerFenced``.

        ``acquire``: the operation records its owner when nobody owns the participant (prepare,
        restore, owner). ``take_over``: replace a current owner, fencing it.
        """
        if owner is not None and owner in self._fenced:
            raise OwnerFenced(
                f"owner {owner} was taken over by {self._fenced[owner]} and is fenced for good: it may not "
                f"{operation} this deployment again",
                owner=owner,
                by=self._fenced[owner],
            )
        current = self.owner
        if current is None:
            if owner is not None and (acquire or take_over):
                self._record(owner, deadline_ts)
            return
        if owner == current:
            self._record(owner, deadline_ts)
            return
        if owner is not None and take_over:
            self._fenced[current] = owner
            self._fenced.move_to_end(current)
            while len(self._fenced) > FENCED_MEMORY:
                self._fenced.popitem(last=False)
            logger.warning("owner %s took this deployment over from %s, which is fenced for good", owner, current)
            self._owner = self._expires_at = None
            self._record(owner, deadline_ts)
            return
        caller = f"owner {owner}" if owner is not None else "a controller that sends no owner"
        assert self._expires_at is not None
        raise OwnerConflict(
            f"this deployment is owned by {current} until {_when(self._expires_at)}: {caller} may not {operation} "
            f"it; to take it over (which fences {current} for good) call with take_over",
            owner=current,
            expires_at=self._expires_at,
        )

    def release(self, owner: str) -> bool:
        """End ``owner``'s ownership; False when it did not own the participant (nothing changes)."""
        if owner in self._fenced:
            raise OwnerFenced(
                f"owner {owner} was taken over by {self._fenced[owner]} and is fenced for good",
                owner=owner,
                by=self._fenced[owner],
            )
        if self.owner != owner:
            return False
        self._owner = self._expires_at = None
        return True
