from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from nemo_gym_checkpoint_plugin._identity import (
    AmbiguousEpisodeId,
    EpisodeId,
    capture_key,
    construct_episode,
    episode_from_wire,
    episode_id,
    episode_to_wire,
    from_capture_key,
    make_episode_id,
)

# Valid Gym rollout ids: the safe-name pattern, minus the reserved "-a<N>" suffix.
rollout_ids = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,40}\Z").filter(
    lambda value: not re.search(r"-a[1-9][0-9]*$", value)
)
attempts = st.integers(min_value=0, max_value=10**6)


@given(rollout_ids, attempts)
def test_capture_key_round_trips(rollout_id: str, attempt: int) -> None:
    episode = EpisodeId(rollout_id=rollout_id, attempt=attempt)
    assert from_capture_key(episode.capture_key) == episode


@given(rollout_ids, attempts)
def test_capture_key_is_gyms_rule_and_the_wire_form_round_trips(rollout_id: str, attempt: int) -> None:
    episode = EpisodeId(rollout_id=rollout_id, attempt=attempt)
    assert capture_key(rollout_id, attempt) == episode.capture_key
    assert from_capture_key(capture_key(rollout_id, attempt)) == episode
    assert episode_to_wire(episode) == {"rollout_id": rollout_id, "attempt": attempt}
    assert episode_from_wire(episode_to_wire(episode)) == episode


def test_capture_key_by_hand() -> None:
    assert capture_key("r", 0) == "r"
    assert capture_key("r", 1) == "r-a1"
    assert capture_key("task-3", 12) == "task-3-a12"


@given(rollout_ids, attempts)
def test_explicit_id_with_suffix_means_that_attempt(rollout_id: str, attempt: int) -> None:
    key = EpisodeId(rollout_id=rollout_id, attempt=attempt).capture_key
    assert make_episode_id(key) == EpisodeId(rollout_id=rollout_id, attempt=attempt)


def test_capture_key_forms() -> None:
    assert from_capture_key("r") == EpisodeId(rollout_id="r", attempt=0)
    assert from_capture_key("r-a3") == EpisodeId(rollout_id="r", attempt=3)
    assert from_capture_key("task-7-a12") == EpisodeId(rollout_id="task-7", attempt=12)
    # Gym reserves only -a<N> with N >= 1 and no leading zero: these are plain ids.
    assert from_capture_key("r-a0") == EpisodeId(rollout_id="r-a0", attempt=0)
    assert from_capture_key("r-a01") == EpisodeId(rollout_id="r-a01", attempt=0)


def test_explicit_suffix_and_attempt_index_is_refused() -> None:
    with pytest.raises(AmbiguousEpisodeId, match="attempt 2 of 'r'"):
        make_episode_id("r-a2", 1)
    with pytest.raises(AmbiguousEpisodeId):
        make_episode_id("r-a2", 0)
    assert make_episode_id("r", 4) == EpisodeId(rollout_id="r", attempt=4)
    assert make_episode_id("r") == EpisodeId(rollout_id="r", attempt=0)


@pytest.mark.parametrize("key", ["", "-a1", "a b", "../x", "r/a"])
def test_invalid_capture_keys_are_refused(key: str) -> None:
    with pytest.raises(ValidationError):
        from_capture_key(key)


def test_wire_form() -> None:
    assert episode_from_wire({"rollout_id": "r", "attempt": 2}).capture_key == "r-a2"
    with pytest.raises(ValidationError):
        episode_from_wire({"rollout_id": "r", "attempt": -1})
    with pytest.raises(ValidationError):
        episode_from_wire({"rollout_id": "r-a1", "attempt": 0})
    with pytest.raises(ValidationError):
        episode_from_wire({"rollout_id": "r", "attempt": 0, "extra": 1})


# -- the fast paths (plain checks, then an EpisodeId built without validation) ----------------------------------
# Whatever they are given, they must answer exactly as EpisodeId itself: the same episode, or a refusal.

_STATE = ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__")
# Rollout ids near every rule: the pattern's edges, the reserved suffix, a trailing newline, non-ASCII digits.
loose_rollout_ids = st.one_of(
    st.text(alphabet="ab-_.09A\n\u0663é/ ", max_size=12),
    st.sampled_from(["r-a3", "r-a0", "r-a01", "x-a3-a2", "-a1", "a-a12", "r-a3\n", "r\n", "_r", ".r", "r-a"]),
    st.builds(lambda s: s + "-a7", st.text(alphabet="ab-", min_size=1, max_size=6)),
)
loose_attempts = st.one_of(
    st.integers(min_value=-3, max_value=2**70),
    st.booleans(),
    st.floats(allow_nan=False, max_value=5),
    st.sampled_from(["3", None, 3.0]),
)


def _outcome(make: object, *args: object, **kwargs: object) -> tuple[str, object]:
    try:
        episode = make(*args, **kwargs)  # type: ignore[operator]
    except ValidationError as exc:
        return "refused", [(e["type"], e["loc"]) for e in exc.errors()]
    return "episode", tuple(getattr(episode, name) for name in _STATE)


@given(loose_rollout_ids, loose_attempts)
def test_the_fast_episode_id_answers_exactly_as_episode_id(rollout_id: object, attempt: object) -> None:
    expected = _outcome(EpisodeId, rollout_id=rollout_id, attempt=attempt)
    assert _outcome(episode_id, rollout_id, attempt) == expected
    assert _outcome(episode_from_wire, {"rollout_id": rollout_id, "attempt": attempt}) == expected


@given(loose_rollout_ids)
def test_from_capture_key_answers_exactly_as_parsing_into_episode_id(key: str) -> None:
    match = re.match(r"^(?P<prefix>.+)-a(?P<attempt>[1-9][0-9]*)$", key)
    if match is None:
        expected = _outcome(EpisodeId, rollout_id=key, attempt=0)
    else:
        expected = _outcome(EpisodeId, rollout_id=match["prefix"], attempt=int(match["attempt"]))
    assert _outcome(from_capture_key, key) == expected


@pytest.mark.parametrize(
    "wire",
    [
        {"rollout_id": "r-a3", "attempt": 0},  # the reserved suffix
        {"rollout_id": "r-a3\n", "attempt": 0},
        {"rollout_id": "r\n", "attempt": 1},
        {"rollout_id": "r", "attempt": -1},
        {"rollout_id": "r", "extra": 1},
        {"attempt": 1},
    ],
)
def test_the_fast_paths_refuse_what_episode_id_refuses(wire: dict) -> None:
    with pytest.raises(ValidationError) as expected:
        EpisodeId.model_validate(wire)
    with pytest.raises(ValidationError) as fast:
        episode_from_wire(wire)
    assert fast.value.errors(include_context=False) == expected.value.errors(include_context=False)
    if wire.keys() <= {"rollout_id", "attempt"}:
        with pytest.raises(ValidationError):
            episode_id(wire.get("rollout_id"), wire.get("attempt", 0))


def test_a_constructed_episode_id_is_the_validated_one() -> None:
    made, validated = construct_episode("task-7", 3), EpisodeId(rollout_id="task-7", attempt=3)
    assert all(getattr(made, name) == getattr(validated, name) for name in _STATE)
    assert made == validated and hash(made) == hash(validated) and {made: 1}[validated] == 1
    assert made.model_dump() == validated.model_dump() and made.model_dump_json() == validated.model_dump_json()
    assert made.capture_key == "task-7-a3" and repr(made) == repr(validated)
    with pytest.raises(ValidationError):
        made.attempt = 4  # frozen, as Gym's model is
