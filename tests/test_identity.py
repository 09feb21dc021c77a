from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from nemo_gym_checkpoint_plugin._identity import (
    AmbiguousEpisodeId,
    EpisodeId,
    episode_from_wire,
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
