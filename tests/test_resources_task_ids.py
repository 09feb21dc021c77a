"""The resources participant's TaskId to and from JSON by plain checks: the same as pydantic's, or pydantic's itself."""

from __future__ import annotations

from typing import Any

import pytest
from nemo_gym.episode_types import TaskId
from nemo_gym_checkpoint_plugin.builtin_participants.resources import task_ids
from pydantic import ValidationError

ACCEPTED = [
    {"taskset": "env:set", "task_id": "t-1"},
    {"taskset": " spaced ", "task_id": "ünïcode"},
    {"task_id": "keys in another order", "taskset": "s"},
]
REFUSED: list[Any] = [
    {"taskset": "", "task_id": "t"},
    {"taskset": "s", "task_id": ""},
    {"taskset": "s"},
    {"taskset": "s", "task_id": "t", "extra": 1},
    {"taskset": 1, "task_id": "t"},
    {"taskset": None, "task_id": "t"},
    None,
    ["s", "t"],
    "s/t",
]


def test_this_gym_gets_the_plain_pair() -> None:
    # The self-check accepted this release's TaskId (a Gym that changes it gets pydantic's own instead).
    assert task_ids.task_id_to_wire.__name__ == "to_wire"
    assert task_ids.task_id_from_wire.__name__ == "from_wire"


@pytest.mark.parametrize("wire", ACCEPTED)
def test_a_valid_task_id_is_what_pydantic_builds(wire: dict[str, Any]) -> None:
    made, validated = task_ids.task_id_from_wire(dict(wire)), TaskId.model_validate(dict(wire))
    assert type(made) is TaskId and made == validated and hash(made) == hash(validated)
    assert made.model_fields_set == validated.model_fields_set
    assert task_ids.task_id_to_wire(made) == validated.model_dump(mode="json")
    assert list(task_ids.task_id_to_wire(made)) == list(validated.model_dump(mode="json"))
    with pytest.raises(ValidationError):
        made.taskset = "changed"  # still frozen


@pytest.mark.parametrize("wire", REFUSED)
def test_an_invalid_task_id_is_refused_as_pydantic_refuses_it(wire: Any) -> None:
    with pytest.raises(ValidationError):
        TaskId.model_validate(wire)
    with pytest.raises(ValidationError):
        task_ids.task_id_from_wire(wire)


def test_a_subclass_is_dumped_by_pydantic() -> None:
    class Wider(TaskId):
        note: str = "n"

    assert task_ids.task_id_to_wire(Wider(taskset="s", task_id="t")) == {"taskset": "s", "task_id": "t", "note": "n"}
