"""One controller per deployment, from the controller's side: claim, renew, take over, release.

Every participant keeps an owner lease (docs/protocol.md, "One controller per deployment"). A
``Coordinator`` whose ``owner`` is set sends it in every control call (``status`` aside), so a
participant owned by another controller refuses the call (``owner_conflict``, naming the owner)
before it changes anything. ``claim`` takes ownership of every participant at once (or renews it,
or, with ``take_over``, fences the current owner for good); ``release`` gives it back. A coordinator
without an owner sends none and behaves as before owners existed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from ._discovery import Participant
from ._errors import CoordinationError, ParticipantFailure
from ._transport import encode_body

__all__ = ["OWNER_CONFLICT", "OWNER_FENCED", "OwnershipMixin", "holders"]

OWNER_CONFLICT = "owner_conflict"
OWNER_FENCED = "owner_fenced"


def holders(statuses: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Owner id -> the participants whose status names it as their owner (owned ones only)."""
    owned: dict[str, list[str]] = {}
    for name, status in sorted(statuses.items()):
        owner = status.get("owner")
        if isinstance(owner, str):
            owned.setdefault(owner, []).append(name)
    return owned


class _FanOut(Protocol):
    """What ownership needs of the coordinator it is mixed into (no import of it: no cycle)."""

    owner: str | None
    participants: list[Participant]
    reply_grace: float

    async def _call_stage(
        self,
        operation: str,
        members: Sequence[Participant],
        body: bytes | None,
        timeout: float,
        counter: list[int],
        total: int,
    ) -> tuple[dict[str, dict[str, Any]], list[ParticipantFailure]]: ...

    async def _owner_call(
        self, body: dict[str, Any], timeout: float | None, what: str
    ) -> dict[str, dict[str, Any]]: ...


class OwnershipMixin:
    owner: str | None

    async def _owner_call(
        self: _FanOut, body: dict[str, Any], timeout: float | None, what: str
    ) -> dict[str, dict[str, Any]]:
        deadline = time.time() + (60.0 if timeout is None else timeout)
        raw = encode_body({**body, "deadline_ts": deadline})
        replies, failures = await self._call_stage(
            "owner", self.participants, raw, deadline - time.time() + self.reply_grace, [0], len(self.participants)
        )
        if failures:
            raise CoordinationError(
                "owner", failures, result=replies, message=f"{what} failed on {len(failures)} server(s)"
            )
        return replies

    async def claim(
        self: _FanOut, owner: str, *, take_over: bool = False, timeout: float | None = None
    ) -> dict[str, dict[str, Any]]:
        """Own every participant as ``owner`` (or renew it); ``take_over`` fences a current owner for good.

        Raises ``CoordinationError`` (code ``owner_conflict`` naming the owner, ``owner_fenced`` when
        ``owner`` itself was taken over) when some participant refused; those that accepted stay owned
        until their lease ends or ``release``. On success every later call of this coordinator names
        ``owner``.
        """
        body: dict[str, Any] = {"owner": owner}
        if take_over:
            body["take_over"] = True
        replies = await self._owner_call(body, timeout, f"owning the deployment as {owner}")
        self.owner = owner
        return replies

    async def release(self: _FanOut, *, timeout: float | None = None) -> dict[str, dict[str, Any]]:
        """Give up ownership on every participant (those this owner does not own are left as they are)."""
        if self.owner is None:
            return {}
        replies = await self._owner_call(
            {"owner": self.owner, "release": True}, timeout, f"releasing the deployment from {self.owner}"
        )
        self.owner = None
        return replies


def fenced(failures: list[ParticipantFailure]) -> bool:
    return any(f.code == OWNER_FENCED for f in failures)
