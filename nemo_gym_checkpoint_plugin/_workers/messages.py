"""What the coordinator and its workers send each other: op names and the shapes of their bodies.

Episode ids travel as ``[rollout_id, attempt]`` pairs (a retire of 200,000 ids stays small),
readiness as the fields of ``Readiness``, restored records as their checkpointed and
replacement pairs with the record. Everything is plain JSON for the link's codec.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from nemo_gym_checkpoint_plugin._identity import EpisodeId, episode_id
from nemo_gym_checkpoint_plugin._types import PrepareReport, Readiness, RestoredRecord

__all__ = [
    "CHECK_OWNERS",
    "CLAIM",
    "CLOSE_ADMISSION",
    "CONTROL",
    "DELETE_RESTORED",
    "EXPORT",
    "FORGET",
    "GATE_FIGURES",
    "MARK",
    "OPEN_ADMISSION",
    "PREPARING",
    "READINESS",
    "READY",
    "RELEASE_EXPORTED",
    "RESTORED_PENDING",
    "RETIRE",
    "STATUS_FIELDS",
    "SERVED",
    "SESSION_CLOSED",
    "UNCLAIM",
    "WAIT_READY",
    "episodes_from_wire",
    "episodes_to_wire",
    "readiness_from_wire",
    "readiness_to_wire",
    "restored_from_wire",
    "restored_to_wire",
]

# Coordinator -> worker.
CLOSE_ADMISSION = "close_admission"
PREPARING = "preparing"
OPEN_ADMISSION = "open_admission"
READY = "ready"
WAIT_READY = "wait_ready"
EXPORT = "export"
RELEASE_EXPORTED = "release_exported"
RESTORED_PENDING = "restored_pending"
DELETE_RESTORED = "delete_restored"
MARK = "mark"
RETIRE = "retire"
FORGET = "forget"
CHECK_OWNERS = "check_owners"
STATUS_FIELDS = "status_fields"
# The worker's admission gate: its counters and its parks' waits (``gates.py``), asked before a metrics scrape.
GATE_FIGURES = "gate_figures"
# Worker -> coordinator (besides ``register``, roster.py).
CLAIM = "claim"
UNCLAIM = "unclaim"
SERVED = "served"
# The worker's readiness, pushed when it changes: ``{"checkpoint_id", "closed_for", **readiness}``.
READINESS = "readiness"
# A resources session a worker closed (``{"session_id", "episode"}``): relayed to every other worker.
SESSION_CLOSED = "session_closed"
# A control request that reached the worker on the shared port (``forward.py``), answered by the coordinator.
CONTROL = "control"


def episodes_to_wire(episodes: Iterable[EpisodeId]) -> list[list[Any]]:
    return [[episode.rollout_id, episode.attempt] for episode in episodes]


def episodes_from_wire(pairs: Any) -> list[EpisodeId]:
    """Episode ids from ``[rollout_id, attempt]`` pairs, validated (``ValueError`` for a bad one)."""
    if not isinstance(pairs, list):
        raise ValueError(f"episode ids must be a list of [rollout_id, attempt] pairs, not {type(pairs).__name__}")
    episodes = []
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ValueError(f"an episode id must be a [rollout_id, attempt] pair, not {pair!r:.80}")
        episodes.append(episode_id(pair[0], pair[1]))
    return episodes


def readiness_to_wire(report: PrepareReport) -> dict[str, Any]:
    return {
        "blockers": list(report.blockers),
        "restarts": list(report.restarts),
        "counts": dict(report.counts),
        "worker_blockers": list(report.worker_blockers),
    }


def readiness_from_wire(body: Mapping[str, Any]) -> Readiness:
    return Readiness(
        blockers=[str(key) for key in body.get("blockers", ())],
        restarts=[str(key) for key in body.get("restarts", ())],
        counts={str(name): int(value) for name, value in dict(body.get("counts", {})).items()},
        worker_blockers=[str(text) for text in body.get("worker_blockers", ())],
    )


def restored_to_wire(restored: RestoredRecord) -> dict[str, Any]:
    return {
        "checkpointed": [restored.checkpointed.rollout_id, restored.checkpointed.attempt],
        "replacement": [restored.replacement.rollout_id, restored.replacement.attempt],
        "record": dict(restored.record),
    }


def restored_from_wire(body: Mapping[str, Any]) -> RestoredRecord:
    checkpointed, replacement = episodes_from_wire([body["checkpointed"], body["replacement"]])
    record = body["record"]
    if not isinstance(record, dict):
        raise ValueError(f"a restored record must be a JSON object, not {type(record).__name__}")
    return RestoredRecord(checkpointed=checkpointed, replacement=replacement, record=record)
