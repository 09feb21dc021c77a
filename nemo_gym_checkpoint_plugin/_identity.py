"""Episode identity: Gym's own ``EpisodeId`` plus the parsing rules the protocol adds.

Gym's ``EpisodeId`` refuses a ``rollout_id`` ending in ``-a<N>`` (N >= 1) so that
``capture_key`` (``r`` / ``r-aN``) stays injective. The protocol adds the way back
(``from_capture_key``) and the explicit-id rule: an id given as ``<id>-aN`` with no
attempt index means attempt N of ``<id>``; an explicit suffix *and* an attempt
index would decode ambiguously and is refused.
"""

from __future__ import annotations

import re
from typing import Any

from nemo_gym.episode_types import EpisodeId

__all__ = ["EpisodeId", "from_capture_key", "make_episode_id", "episode_from_wire", "AmbiguousEpisodeId"]

# The same suffix Gym reserves (its validator uses this pattern): -a0 and -a01 are plain ids.
_ATTEMPT_SUFFIX = re.compile(r"^(?P<prefix>.+)-a(?P<attempt>[1-9][0-9]*)$")


class AmbiguousEpisodeId(ValueError):
    """An explicit ``-aN`` suffix was given together with an attempt index."""


def from_capture_key(key: str) -> EpisodeId:
    """Parse a capture key back: ``r`` is attempt 0 of ``r``, ``r-aN`` is attempt N of ``r``.

    Raises ``ValueError`` (pydantic's, a subclass) when the key names no valid episode.
    """
    match = _ATTEMPT_SUFFIX.match(key)
    if match is None:
        return EpisodeId(rollout_id=key, attempt=0)
    return EpisodeId(rollout_id=match["prefix"], attempt=int(match["attempt"]))


def make_episode_id(rollout_id: str, attempt: int | None = None) -> EpisodeId:
    """Build an episode id from an explicit rollout id and an optional attempt index.

    ``make_episode_id("r-a2")`` is attempt 2 of ``r``; ``make_episode_id("r-a2", 1)``
    is refused with ``AmbiguousEpisodeId``: both the suffix and the index claim the attempt.
    """
    match = _ATTEMPT_SUFFIX.match(rollout_id)
    if match is None:
        return EpisodeId(rollout_id=rollout_id, attempt=0 if attempt is None else attempt)
    if attempt is not None:
        raise AmbiguousEpisodeId(
            f"rollout id {rollout_id!r} already names attempt {match['attempt']} of {match['prefix']!r}; "
            f"it cannot also be given attempt index {attempt}: pass either the suffix or the index"
        )
    return EpisodeId(rollout_id=match["prefix"], attempt=int(match["attempt"]))


def episode_from_wire(value: Any) -> EpisodeId:
    """Validate a wire episode id ``{"rollout_id": ..., "attempt": N}`` (or an ``EpisodeId``)."""
    if isinstance(value, EpisodeId):
        return value
    return EpisodeId.model_validate(value)
