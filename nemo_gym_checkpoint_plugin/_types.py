"""Values exchanged between the control plane and participant plugins.

Participants answer hooks with these (or with the plain shapes each docstring
allows); the control plane merges the answers of every plugin of one server.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_gym_checkpoint_plugin._errors import InvalidPhase
from nemo_gym_checkpoint_plugin._identity import EpisodeId, capture_key, construct_episode

__all__ = [
    "MAX_REPORTED_BLOCKERS",
    "MAX_DEADLINE_AHEAD_SECONDS",
    "DeadlineTooFar",
    "AdmissionNotReopened",
    "Phase",
    "Readiness",
    "PrepareReport",
    "ParticipantExport",
    "RestoredRecord",
    "Versioned",
    "plain_record",
    "plain_records",
    "SeedDeclaration",
    "LeasePolicy",
    "merge_readiness",
    "EpisodeIds",
    "rollout_attempts",
    "sorted_keys",
]

# docs/protocol.md: a report lists at most 100 blockers (the full count is reported beside them).
MAX_REPORTED_BLOCKERS = 100

# The furthest ahead a deadline_ts may be, from the plane's clock: 24 hours. Every control call extends
# the lease to deadline_ts + lease_grace_seconds, so a deadline in milliseconds would make it endless.
MAX_DEADLINE_AHEAD_SECONDS = 24 * 3600.0


class DeadlineTooFar(ValueError):
    """A ``deadline_ts`` more than ``MAX_DEADLINE_AHEAD_SECONDS`` ahead (seconds, not milliseconds).

    A malformed argument, refused before anything changes; the routes render it as a 422 body
    error on ``deadline_ts``, like a deadline that is not a finite number.
    """

    def __init__(self, deadline_ts: float, now: float) -> None:
        super().__init__(
            f"deadline_ts {deadline_ts!r} is {deadline_ts - now:.0f} s ahead; at most "
            f"{MAX_DEADLINE_AHEAD_SECONDS:.0f} s (24 hours) ahead is accepted: an absolute Unix time in seconds"
        )
        self.deadline_ts = deadline_ts


class AdmissionNotReopened(InvalidPhase):
    """A resume could not reopen admission: a participant's ``open_admission`` hook raised (again).

    The plane is idle and its own gate open; the reopening stays pending and the next resume retries it.
    """


class Phase(enum.StrEnum):
    IDLE = "idle"
    PREPARING = "preparing"
    PREPARED = "prepared"
    COMMITTED = "committed"
    RESTORED = "restored"


@dataclass(frozen=True)
class Readiness:
    """One plugin's answer to ``ready``: what blocks a checkpoint right now, and what cannot be captured.

    ``blockers`` and ``restarts`` are capture keys; ``counts`` are free-form tallies
    (``{"in_flight": 3}``) summed across plugins. ``worker_blockers`` block like ``blockers`` but
    are not episodes: what keeps a server with several workers from being ready (``worker 4242
    disconnected during step-3``, ``worker not registered (3 of 4), #1``); reported apart
    (``worker_blockers`` on the wire) so ``blockers`` stays a list of capture keys.
    """

    blockers: Collection[str] = ()
    restarts: Collection[str] = ()
    counts: Mapping[str, int] = field(default_factory=dict)
    worker_blockers: Collection[str] = ()


@dataclass(frozen=True)
class PrepareReport:
    """The merged readiness of one participant, as docs/protocol.md's prepare report."""

    blockers: tuple[str, ...]
    restarts: tuple[str, ...]
    counts: Mapping[str, int]
    worker_blockers: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        # Restarts never block: they run through the checkpoint and are never exported.
        return not self.blockers and not self.worker_blockers

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "ready": self.ready,
            "blockers": list(self.blockers[:MAX_REPORTED_BLOCKERS]),
            "blocker_count": len(self.blockers),
            "counts": dict(self.counts),
            "restarts": list(self.restarts),
        }
        if self.worker_blockers:
            # Only a server with several workers has them: every other report keeps its exact shape.
            wire["worker_blockers"] = list(self.worker_blockers[:MAX_REPORTED_BLOCKERS])
        return wire


def merge_readiness(answers: Iterable[Readiness | None]) -> PrepareReport:
    """Union of blockers and restarts (sorted, so reports are stable), sum of counts."""
    blockers: set[str] = set()
    restarts: set[str] = set()
    workers: set[str] = set()
    counts: dict[str, int] = {}
    for answer in answers:
        if answer is None:
            continue
        blockers.update(answer.blockers)
        restarts.update(answer.restarts)
        workers.update(answer.worker_blockers)
        for name, value in answer.counts.items():
            counts[name] = counts.get(name, 0) + value
    return PrepareReport(tuple(sorted(blockers)), tuple(sorted(restarts)), counts, tuple(sorted(workers)))


@dataclass
class ParticipantExport:
    """One plugin's answer to ``export``.

    ``records`` are written one at a time (an iterator keeps memory flat); each is a JSON
    object with an ``episode_id``. ``manifest_extras`` go into the manifest under their own
    keys; ``reply_extras`` into the commit reply.
    """

    records: Iterable[Mapping[str, Any]]
    manifest_extras: Mapping[str, Any] = field(default_factory=dict)
    reply_extras: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Versioned:
    """A record an export may yield in place of a plain one: its episode, its version and the record.

    ``version`` is the participant's per-episode counter (any value compared with ``==``: an ``int``
    raised whenever the episode's state changes). When the participant's previous published
    checkpoint holds this episode's record (of this owner) at the same version, and the new
    checkpoint is written beside it (another directory of the same parent), the new checkpoint
    refers to that record instead of writing it again: ``record`` is then never called nor encoded
    (docs/protocol.md, "Incremental checkpoints"). ``record`` is the record (a JSON object whose
    ``episode_id`` is ``episode_id``) or a function of no arguments returning it, called in the
    writer's thread only when the record is written. ``plugin`` is set by the control plane for a
    third-party plugin's records; a plugin never sets it.
    """

    episode_id: Mapping[str, Any]
    version: Any
    record: Mapping[str, Any] | Callable[[], Mapping[str, Any]]
    plugin: str | None = None


def plain_record(item: Any) -> Any:
    """What the writer writes for an export's ``item``: a ``Versioned``'s record (built when it is a function,
    tagged with its plugin as the writer tags it), any other item as it is. For exports that are not
    written by a checkpoint writer (a worker's records sent to its coordinator, a test reading an export)."""
    if type(item) is not Versioned:
        return item
    record = item.record() if callable(item.record) else item.record
    if item.plugin is not None and isinstance(record, Mapping) and "plugin" not in record:
        record = {**record, "plugin": item.plugin}
    return record


def plain_records(items: Iterable[Any]) -> list[Any]:
    """``plain_record`` of each item, in a list."""
    return [plain_record(item) for item in items]


@dataclass(frozen=True)
class RestoredRecord:
    """A record a restore read, and the attempt that continues it (``checkpointed.attempt + 1``)."""

    checkpointed: EpisodeId
    replacement: EpisodeId
    record: Mapping[str, Any]


@dataclass(frozen=True)
class SeedDeclaration:
    """What a resources participant declares about a seeded session (sent as reply headers)."""

    restart: bool = False
    verify_replay: bool = False


@dataclass(frozen=True)
class LeasePolicy:
    """How long a participant waits for its controller, and how often a failed self-resume retries.

    ``grace_seconds`` is docs/protocol.md's ``lease_grace_seconds``; ``retry_seconds`` is 30 by default.
    """

    grace_seconds: float
    retry_seconds: float = 30.0

    def __post_init__(self) -> None:
        for name in ("grace_seconds", "retry_seconds"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"LeasePolicy.{name} must be a finite number of seconds > 0, got {value!r}")

    def expires_at(self, deadline_ts: float) -> float:
        return deadline_ts + self.grace_seconds


class EpisodeIds(Sequence[EpisodeId]):
    """Episode ids validated in bulk (``control/bodies.py``): ``(rollout_id, attempt)`` pairs and their
    sorted, deduplicated capture keys, computed off the event loop.

    A commit or restore needs only those; ``EpisodeId`` objects (costly by the hundred thousand) are
    made on first use, or up front in the parsing thread when the route hands them to hooks (retire).
    """

    def __init__(self, pairs: list[tuple[str, int]], sorted_capture_keys: tuple[str, ...] | None = None) -> None:
        self.pairs = pairs
        self._keys = sorted_capture_keys
        self._episodes: list[EpisodeId] | None = None

    @property
    def sorted_capture_keys(self) -> tuple[str, ...]:
        if self._keys is None:
            self._keys = tuple(sorted({capture_key(r, a) for r, a in self.pairs}))
        return self._keys

    def materialized(self) -> list[EpisodeId]:
        if self._episodes is None:
            # The pairs were validated as EpisodeId would: build them without validating again.
            self._episodes = [construct_episode(rollout_id, attempt) for rollout_id, attempt in self.pairs]
        return self._episodes

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: Any) -> Any:
        return self.materialized()[index]

    def __iter__(self) -> Iterator[EpisodeId]:
        return iter(self.materialized())

    def __repr__(self) -> str:
        return f"EpisodeIds({len(self.pairs)} episodes)"


def rollout_attempts(episodes: Sequence[EpisodeId]) -> Iterable[tuple[str, int]]:
    """``(rollout_id, attempt)`` of each episode, without making ``EpisodeId`` objects when not needed."""
    if isinstance(episodes, EpisodeIds):
        return episodes.pairs
    return [(episode.rollout_id, episode.attempt) for episode in episodes]


def sorted_keys(episodes: Sequence[EpisodeId] | None) -> tuple[str, ...] | None:
    """A scope as its sorted capture keys (``None`` stays ``None``): how retries are compared."""
    if episodes is None:
        return None
    if isinstance(episodes, EpisodeIds):
        return episodes.sorted_capture_keys
    return tuple(sorted({episode.capture_key for episode in episodes}))
