"""``attempts.split_key`` and ``RetiredBy``: the retire rule over capture keys, as ``from_capture_key`` reads them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from nemo_gym_checkpoint_plugin.builtin_participants.shared.attempts import RetiredBy, split_key

from nemo_gym_checkpoint_plugin._identity import EpisodeId, from_capture_key

_ROLLOUT = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,12}\Z").filter(lambda r: from_capture_key(r).attempt == 0)


@given(_ROLLOUT, st.integers(min_value=0, max_value=10**6))
def test_split_key_inverts_every_capture_key(rollout_id: str, attempt: int) -> None:
    assert split_key(EpisodeId(rollout_id=rollout_id, attempt=attempt).capture_key) == (rollout_id, attempt)


@given(st.text(alphabet="ra-019١._", min_size=1, max_size=12))
def test_split_key_reads_any_key_as_from_capture_key_does(key: str) -> None:
    try:
        expected = from_capture_key(key)
    except ValueError:
        return  # names no episode: no participant holds such a key
    assert split_key(key) == (expected.rollout_id, expected.attempt)


def test_a_retire_names_each_listed_attempt_and_the_earlier_ones_of_its_rollout() -> None:
    named = RetiredBy([EpisodeId(rollout_id="r", attempt=1), EpisodeId(rollout_id="s"), EpisodeId(rollout_id="r")])
    assert [named.key(k) for k in ("r", "r-a1", "r-a2", "s", "s-a1", "t", "r-a10")] == [
        True,
        True,
        False,
        True,
        False,
        False,
        False,
    ]
    assert named(EpisodeId(rollout_id="r", attempt=1)) and not named(EpisodeId(rollout_id="t"))
