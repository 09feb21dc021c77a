"""What the coordination operations return.

``PrepareResult`` is what a controller builds its commit scope from: the
participants' prepare reports, whether every stage became ready, the blockers
that kept it from being ready, and the restarts (episodes some participant
cannot capture) that a commit scope must leave out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .._identity import EpisodeId, episode_from_wire, episode_to_wire, from_capture_key
from .._identity import capture_key as key_of
from ._errors import ATTEMPT_RUNNING, INCONSISTENT_CHECKPOINT, ParticipantFailure

__all__ = ["CommitResult", "PrepareResult", "RestoreResult", "capture_key", "created_replacements", "wire_episode_id"]


def wire_episode_id(value: Any) -> dict[str, Any]:
    """An episode id as the wire's ``{"rollout_id", "attempt"}``, from a capture key, a dict or an EpisodeId."""
    return episode_to_wire(_episode(value))


def capture_key(value: Any) -> str:
    """The capture key (``r`` / ``r-aN``) of an episode id given in any of the accepted forms."""
    episode = _episode(value)
    return key_of(episode.rollout_id, episode.attempt)


def _episode(value: Any) -> EpisodeId:
    return from_capture_key(value) if isinstance(value, str) else episode_from_wire(value)


@dataclass
class PrepareResult:
    """The outcome of a staged prepare.

    ``reports`` maps each participant that replied to its prepare report, ``phases`` to
    its phase. ``ready`` is true only when every stage was reached and every participant
    replied ``prepared`` with a ready report. ``stopped_at`` names the kinds of the first
    stage that was not ready by the deadline (later stages were never called: their
    participants are in ``not_reached``).
    """

    checkpoint_id: str
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    phases: dict[str, str] = field(default_factory=dict)
    stopped_at: list[str] | None = None
    not_reached: list[str] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return (
            self.stopped_at is None
            and not self.not_reached
            and all(phase == "prepared" for phase in self.phases.values())
            and all(report.get("ready") is True for report in self.reports.values())
        )

    def blockers(self) -> list[str]:
        """Capture keys that kept some participant from being ready (sorted, each once).

        Each participant lists at most 100; ``blocker_count()`` is the full count.
        """
        keys: set[str] = set()
        for report in self.reports.values():
            keys.update(report.get("blockers") or ())
        return sorted(keys)

    def worker_blockers(self) -> list[str]:
        """What kept a server with several workers from being ready that is not an episode (sorted, each once).

        Each names a worker (``worker 4242 disconnected during step-3``); a report has them only then.
        """
        named: set[str] = set()
        for report in self.reports.values():
            named.update(report.get("worker_blockers") or ())
        return sorted(named)

    def blocker_count(self) -> int:
        """The participants' full blocker counts, added up."""
        return sum(int(report.get("blocker_count") or 0) for report in self.reports.values())

    def restarts(self) -> list[str]:
        """Every capture key some participant cannot capture (never capped; sorted, each once)."""
        keys: set[str] = set()
        for report in self.reports.values():
            keys.update(report.get("restarts") or ())
        return sorted(keys)

    def continued(self, episode_ids: Iterable[Any]) -> list[dict[str, Any]]:
        """The commit scope: ``episode_ids`` (the ``/run`` calls not yet returned) minus the restarts.

        Accepts capture keys, wire dicts or ``EpisodeId``; returns wire ids in the given order,
        each once.
        """
        restarts = set(self.restarts())
        scope: list[dict[str, Any]] = []
        seen: set[str] = set()
        for value in episode_ids:
            key = capture_key(value)
            if key in restarts or key in seen:
                continue
            seen.add(key)
            scope.append(wire_episode_id(value))
        return scope

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "ready": self.ready,
            "phases": self.phases,
            "reports": self.reports,
            "stopped_at": self.stopped_at,
            "not_reached": self.not_reached,
            "blockers": self.blockers(),
            "blocker_count": self.blocker_count(),
            "restarts": self.restarts(),
        } | ({"worker_blockers": workers} if (workers := self.worker_blockers()) else {})


@dataclass
class CommitResult:
    """Each participant's commit reply: its manifest and the capture keys it wrote."""

    checkpoint_id: str
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def manifests(self) -> dict[str, dict[str, Any]]:
        return {name: reply.get("manifest") or {} for name, reply in self.replies.items()}

    @property
    def episode_ids(self) -> dict[str, list[str]]:
        return {name: list(reply.get("episode_ids") or ()) for name, reply in self.replies.items()}

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint_id": self.checkpoint_id, "replies": self.replies}


@dataclass
class RestoreResult:
    """Each participant's restore reply; ``restored`` is every replacement attempt's capture key."""

    checkpoint_id: str
    source_checkpoint_id: str
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)

    def restored(self) -> list[str]:
        keys: set[str] = set()
        for reply in self.replies.values():
            keys.update(reply.get("restored") or ())
        return sorted(keys)

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "source_checkpoint_id": self.source_checkpoint_id,
            "restored": self.restored(),
            "replies": self.replies,
        }


def created_replacements(
    checkpointed: list[dict[str, Any]], replies: dict[str, dict[str, Any]], failures: list[ParticipantFailure]
) -> tuple[list[dict[str, Any]], list[str]]:
    """(the replacements a failed restore created, to retire; the capture keys it leaves alone).

    A participant that replied restored its ``restored``; one that refused (a protocol code) installed
    nothing; one that never replied may have installed any of them. ``attempt_running`` names
    replacements another controller runs: never retired, whoever else installed them.
    """
    running = {key for f in failures if f.code == ATTEMPT_RUNNING for key in f.episodes}
    replacements = {
        capture_key(r): r for r in ({"rollout_id": e["rollout_id"], "attempt": e["attempt"] + 1} for e in checkpointed)
    }
    if any(f.status is None and f.code != INCONSISTENT_CHECKPOINT for f in failures):
        created = set(replacements)
    else:
        created = {key for reply in replies.values() for key in reply.get("restored") or () if key in replacements}
    return [replacements[key] for key in sorted(created - running)], sorted(running & set(replacements))
