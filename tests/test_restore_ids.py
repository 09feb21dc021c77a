"""A restore builds the ids of each record it read (not of every episode in its scope) from the scope's
validated pair, without validating again; a record the scope does not name exactly (a storage backend of
one's own may return one) gets EpisodeId's own answer."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nemo_gym_checkpoint_plugin._control import restore as restore_module
from nemo_gym_checkpoint_plugin._control.restore import _restored_record
from nemo_gym_checkpoint_plugin._identity import EpisodeId, from_capture_key

SCOPE = ["r", "r-a1", "r-a2", "task.7"]


def ids() -> dict:
    return dict.fromkeys((e.rollout_id, e.attempt) for e in map(from_capture_key, SCOPE))


def test_a_record_of_the_scope_gets_its_ids_without_validating_again(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(wire: object) -> None:
        raise AssertionError(f"validated again: {wire}")

    monkeypatch.setattr(restore_module, "episode_from_wire", refuse)
    restored = _restored_record({"episode_id": {"rollout_id": "r", "attempt": 2}, "x": 1}, ids())
    assert restored.checkpointed == EpisodeId(rollout_id="r", attempt=2)
    assert restored.replacement == EpisodeId(rollout_id="r", attempt=3)
    assert restored.record["x"] == 1


@pytest.mark.parametrize(
    "wire",
    [
        {"rollout_id": "other", "attempt": 0},  # not in the scope
        {"rollout_id": "r", "attempt": True},  # equal to ("r", 1) as a key, but not an int
        {"rollout_id": "r", "attempt": 2.0},  # equal to ("r", 2) as a key, but a float
        {"rollout_id": "r", "attempt": 2, "extra": 1},
        {"rollout_id": "r-a3", "attempt": 0},
    ],
)
def test_a_record_the_scope_does_not_name_exactly_gets_episode_ids_answer(wire: dict) -> None:
    record = {"episode_id": wire}
    try:
        expected = EpisodeId.model_validate(wire)
    except ValidationError:
        with pytest.raises(ValidationError):
            _restored_record(record, ids())
        return
    restored = _restored_record(record, ids())
    assert restored.checkpointed == expected
    assert restored.replacement == EpisodeId(rollout_id=expected.rollout_id, attempt=expected.attempt + 1)
