"""Typed failures of the controller side.

A fan-out never stops at the first bad reply without saying who else failed:
every operation collects one ``ParticipantFailure`` per failing server and
raises one ``CoordinationError`` naming each of them with its error code.

Codes are the participant's own docs/protocol.md code when it sent a refusal
(``{"error": {"code", "detail"}}``), else one of the controller-side codes
below, which never come from a participant:

- ``unreachable``: the connection was refused or dropped (server down).
- ``timeout``: no complete reply within the bound (a hung server).
- ``bad_reply``: a reply that is not the JSON the protocol promises.
- ``unknown_kind``: ``status`` named a kind outside environment/model/agent/resources.
- ``no_model_participant``: discovery found no participant of kind ``model``.
- ``unresolved_address``: a config block gives its server no host/port, and no head
  server resolved it.
- ``inconsistent_checkpoint``: participants restored different checkpoints.

``ATTEMPT_RUNNING`` is the participants' code for an attempt already running where it was sent:
it lives elsewhere, so a controller never records it as a failure of its row.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ATTEMPT_RUNNING",
    "BAD_REPLY",
    "CoordinationError",
    "INCONSISTENT_CHECKPOINT",
    "NO_MODEL_PARTICIPANT",
    "ParticipantFailure",
    "TIMEOUT",
    "UNKNOWN_KIND",
    "UNREACHABLE",
    "UNRESOLVED_ADDRESS",
]

UNREACHABLE = "unreachable"
TIMEOUT = "timeout"
BAD_REPLY = "bad_reply"
UNKNOWN_KIND = "unknown_kind"
NO_MODEL_PARTICIPANT = "no_model_participant"
UNRESOLVED_ADDRESS = "unresolved_address"
INCONSISTENT_CHECKPOINT = "inconsistent_checkpoint"
ATTEMPT_RUNNING = "attempt_running"


@dataclass(frozen=True)
class ParticipantFailure:
    """One server's failure in one operation: who (``server``, ``url``), why (``code``, ``detail``).

    ``status`` is the HTTP status when the server replied, else ``None``. ``episodes`` are the
    capture keys a refusal named (``attempt_running``'s ``episode_ids``: attempts that live elsewhere).
    """

    server: str
    url: str
    operation: str
    code: str
    detail: str
    status: int | None = None
    episodes: tuple[str, ...] = ()

    def describe(self) -> str:
        status = f" (HTTP {self.status})" if self.status is not None else ""
        return f"{self.server} [{self.url}] {self.operation}: {self.code}{status}: {self.detail}"

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "server": self.server,
            "url": self.url,
            "operation": self.operation,
            "code": self.code,
            "detail": self.detail,
            "status": self.status,
        }
        if self.episodes:
            document["episodes"] = list(self.episodes)
        return document


class CoordinationError(Exception):
    """An operation failed on one or more servers; ``failures`` names each one and its code.

    ``result`` carries what the operation achieved before failing, when that is useful to
    the caller (a ``PrepareResult`` whose earlier stages closed admission, for instance).
    ``cleanup_failures`` lists failures of the clean-up a failed restore runs (retire and
    resume everywhere); they are reported but never replace the original error.
    """

    def __init__(
        self,
        operation: str,
        failures: Iterable[ParticipantFailure],
        *,
        message: str | None = None,
        result: Any = None,
        cleanup_failures: Iterable[ParticipantFailure] = (),
    ) -> None:
        self.operation = operation
        self.failures = list(failures)
        self.result = result
        self.cleanup_failures = list(cleanup_failures)
        lines = [message or f"{operation} failed on {len(self.failures)} server(s)"]
        lines += [f"  {failure.describe()}" for failure in self.failures]
        if self.cleanup_failures:
            lines.append(f"  clean-up also failed on {len(self.cleanup_failures)} call(s):")
            lines += [f"    {failure.describe()}" for failure in self.cleanup_failures]
        super().__init__("\n".join(lines))

    @property
    def codes(self) -> dict[str, str]:
        """Server name to error code (the first failure of each server)."""
        codes: dict[str, str] = {}
        for failure in self.failures:
            codes.setdefault(failure.server, failure.code)
        return codes

    def to_json(self) -> dict[str, Any]:
        return {
            "operation": self.operation,
            "failures": [failure.to_json() for failure in self.failures],
            "cleanup_failures": [failure.to_json() for failure in self.cleanup_failures],
        }
