"""Episode identity on the wire: Gym's own ``EpisodeId``, the capture-key rule, and the protocol's parsing rules.

The one home of the capture-key rule (``capture_key``: ``r`` for attempt 0, ``r-aN`` for attempt
N >= 1, the same rule as Gym's ``EpisodeId.capture_key``) and of the wire form of an episode id
(``episode_to_wire`` / ``episode_from_wire``: ``{"rollout_id": ..., "attempt": N}``). Everything
that writes either, on the server and on the controller side, calls these.

Gym's ``EpisodeId`` refuses a ``rollout_id`` ending in ``-a<N>`` (N >= 1) so that
``capture_key`` (``r`` / ``r-aN``) stays injective. The protocol adds the way back
(``from_capture_key``) and the explicit-id rule: an id given as ``<id>-aN`` with no
attempt index means attempt N of ``<id>``; an explicit suffix *and* an attempt
index would decode ambiguously and is refused.

Episode ids are made by the thousand per checkpoint (every record of a restore, every id
of a scope): ``episode_id`` checks the usual shape with plain checks that accept exactly
what ``EpisodeId`` accepts unchanged and builds it without validation (``construct_episode``);
anything else goes through ``EpisodeId`` itself, which accepts or refuses it with its own error.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from nemo_gym.episode_types import EpisodeId

__all__ = [
    "EpisodeId",
    "capture_key",
    "episode_to_wire",
    "from_capture_key",
    "make_episode_id",
    "episode_from_wire",
    "episode_id",
    "is_plain_episode",
    "construct_episode",
    "AmbiguousEpisodeId",
]

# The same suffix Gym reserves (its validator uses this pattern): -a0 and -a01 are plain ids.
_ATTEMPT_SUFFIX = re.compile(r"^(?P<prefix>.+)-a(?P<attempt>[1-9][0-9]*)$")
# Gym's EpisodeId rules as plain checks: rollout_id's pattern (as a full match: no trailing newline
# either) and its reserved -a<N> suffix; attempt an int >= 0.
_ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*").fullmatch
_RESERVED_SUFFIX = re.compile(r"-a[1-9][0-9]*\Z").search
_WIRE_KEYS = frozenset({"rollout_id", "attempt"})
_STATE = ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__")


def _constructor() -> Any:
    """``construct(rollout_id, attempt)``: an ``EpisodeId`` from values known valid, without validation.

    What ``EpisodeId.model_construct`` stores for this model, without its generic work (aliases,
    defaults, extras: it costs more than validating). A pydantic release that stores a model
    otherwise fails the self-check below and gets ``model_construct`` itself.
    """
    new, setattr_ = EpisodeId.__new__, object.__setattr__

    def construct(rollout_id: str, attempt: int) -> EpisodeId:
        episode = new(EpisodeId)
        setattr_(episode, "__dict__", {"rollout_id": rollout_id, "attempt": attempt})
        setattr_(episode, "__pydantic_fields_set__", {"rollout_id", "attempt"})
        setattr_(episode, "__pydantic_extra__", None)
        setattr_(episode, "__pydantic_private__", None)
        return episode

    def construct_generic(rollout_id: str, attempt: int) -> EpisodeId:
        return EpisodeId.model_construct(rollout_id=rollout_id, attempt=attempt)

    try:
        made, validated = construct("r", 1), EpisodeId(rollout_id="r", attempt=1)
        same = (
            tuple(getattr(EpisodeId, "__slots__", ())) == _STATE
            and not EpisodeId.__pydantic_post_init__
            and not EpisodeId.__private_attributes__
            and list(EpisodeId.model_fields) == ["rollout_id", "attempt"]
            and all(getattr(made, name) == getattr(validated, name) for name in _STATE)
            and made == validated
            and hash(made) == hash(validated)
        )
    except Exception:
        same = False
    return construct if same else construct_generic


construct_episode = _constructor()
_construct = construct_episode


def capture_key(rollout_id: str, attempt: int) -> str:
    """The capture key of attempt ``attempt`` of ``rollout_id``: ``r`` for attempt 0, ``r-aN`` for N >= 1.

    What ``EpisodeId.capture_key`` returns, without building an ``EpisodeId`` (keys are made by the
    hundred thousand). ``from_capture_key`` is the way back.
    """
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


class Episodic(Protocol):
    """Anything naming one attempt of a rollout: an ``EpisodeId``, a collector's row state..."""

    @property
    def rollout_id(self) -> str: ...

    @property
    def attempt(self) -> int: ...


def episode_to_wire(episode: Episodic) -> dict[str, Any]:
    """An episode id as the protocol's bodies and records carry it: ``{"rollout_id": ..., "attempt": N}``."""
    return {"rollout_id": episode.rollout_id, "attempt": episode.attempt}


def is_plain_episode(rollout_id: Any, attempt: Any) -> bool:
    """True when ``EpisodeId(rollout_id=rollout_id, attempt=attempt)`` accepts both exactly as they are.

    False means "ask ``EpisodeId``": it may still accept (coercing, e.g. a str subclass) or refuse.
    """
    return (
        type(rollout_id) is str
        and type(attempt) is int
        and attempt >= 0
        and _ROLLOUT_ID(rollout_id) is not None
        and ("-a" not in rollout_id or _RESERVED_SUFFIX(rollout_id) is None)
    )


def episode_id(rollout_id: Any, attempt: Any = 0) -> EpisodeId:
    """``EpisodeId(rollout_id=..., attempt=...)``, without pydantic's validation when the plain checks pass."""
    if is_plain_episode(rollout_id, attempt):
        return _construct(rollout_id, attempt)
    return EpisodeId(rollout_id=rollout_id, attempt=attempt)


class AmbiguousEpisodeId(ValueError):
    """An explicit ``-aN`` suffix was given together with an attempt index."""


def from_capture_key(key: str) -> EpisodeId:
    """Parse a capture key back: ``r`` is attempt 0 of ``r``, ``r-aN`` is attempt N of ``r``.

    Raises ``ValueError`` (pydantic's, a subclass) when the key names no valid episode.
    """
    match = _ATTEMPT_SUFFIX.match(key) if "-a" in key else None
    if match is None:
        return episode_id(key, 0)
    return episode_id(match["prefix"], int(match["attempt"]))


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
    if type(value) is dict and value.keys() <= _WIRE_KEYS:
        rollout_id, attempt = value.get("rollout_id"), value.get("attempt", 0)
        if is_plain_episode(rollout_id, attempt):
            return _construct(rollout_id, attempt)
    return EpisodeId.model_validate(value)
