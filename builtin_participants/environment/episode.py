"""What the environment participant's ``EpisodeBook`` keeps per episode (see ``episode_book.py``)."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nemo_gym_checkpoint_plugin.builtin_participants.shared.versions import stamp

from nemo_gym_checkpoint_plugin._identity import EpisodeId

__all__ = ["Episode", "RestoredEpisode", "StepMode"]


class StepMode(enum.StrEnum):
    """``checkpoint.step_mode``: what a step in flight does when a checkpoint closes admission."""

    WAIT = "wait"
    REPLAY = "replay"


@dataclass(frozen=True)
class RestoredEpisode:
    """What a restored episode continues from: its checkpointed attempt, boundary and state."""

    checkpointed: EpisodeId
    boundary: str | None
    state: Mapping[str, Any]
    # The digest of the task the checkpointed attempt ran (None: a record of an earlier version or of Gym's
    # own checkpoints, which continues whatever task its replacement carries).
    task_digest: str | None = None
    # Its record's version (``shared.versions``): a restored episode never changes until its attempt begins.
    version: int = field(default_factory=stamp, compare=False)


# The fields an episode's record is made of (or whether it is exported at all): writing any of them
# stamps the episode's record with a new version (``Episode.version``, see ``episode_records.py``).
_RECORDED = frozenset(
    {"episode_id", "key", "restored", "task_digest", "boundary", "state", "restart", "pending_restart", "retiring"}
)


@dataclass(eq=False)
class Episode:
    """One running episode attempt as the book sees it.

    ``version`` is its record's version: every write of a field the record is made of (``_RECORDED``)
    stamps a new one, so a checkpoint refers to the previous record of the episode only while none
    was written. ``state`` is replaced by ``EpisodeBook.reach``, never changed in place: a change made
    inside the dict raises no version (run logic records its state with ``reach``).
    """

    episode_id: EpisodeId
    key: str
    task: asyncio.Task[Any] | None
    restored: RestoredEpisode | None = None
    # The digest of the task this attempt runs (``task_digest``), kept in its record; None when unknown.
    task_digest: str | None = None
    boundary: str | None = None
    state: dict[str, Any] = field(default_factory=dict)
    step: str | None = None
    # Whether the step in flight may run again after a crash (replay mode only blocks on one that may not).
    step_replayable: bool = True
    # The step in flight is captured where it was delegated (EpisodeBook.step(captured=True)): never blocking.
    step_captured: bool = False
    restart: bool = False
    pending_restart: bool = False
    retiring: bool = False
    parked: bool = False
    # The episode's asyncio.Timeout, paused while parked (None: no deadline).
    deadline: asyncio.Timeout | None = None
    # Set last by __init__: a stamp of its own, so no two Episode objects of one attempt share a version.
    version: int = field(default_factory=stamp)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _RECORDED:
            object.__setattr__(self, "version", stamp())
