"""What the environment participant's ``EpisodeBook`` keeps per episode (see ``episode_book.py``)."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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


@dataclass(eq=False)
class Episode:
    """One running episode attempt as the book sees it."""

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
