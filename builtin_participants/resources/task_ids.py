"""Gym's ``TaskId`` to and from its JSON form, by plain checks where they prove the same result.

The resources participant dumps one ``TaskId`` per session binding on every commit and validates
one per restored binding (16,000 of each at the scale benchmark's shape). pydantic's generic
``model_dump``/``model_validate`` cost about 1.5 us each there; ``TaskId`` is two non-empty strings
(``taskset``, ``task_id``), frozen, extras forbidden. So:

- ``task_id_to_wire``: ``{"taskset", "task_id"}`` read from the instance's fields;
- ``task_id_from_wire``: a dict of exactly those two keys holding non-empty ``str`` values is built
  without pydantic's validation (what ``TaskId.model_validate`` would build from it); anything else
  goes to ``TaskId.model_validate``, which accepts (coercing) or refuses it as before.

Both are used only when a self-check at import proves them equal to pydantic's own for this Gym
release (the same fields, no serializers or validators of its own, the same instance state);
otherwise they are pydantic's ``model_dump(mode="json")`` and ``model_validate``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nemo_gym.episode_types import TaskId

__all__ = ["task_id_from_wire", "task_id_to_wire"]

_FIELDS = ("taskset", "task_id")
_STATE = ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__")


def _generic_to_wire(task_id: Any) -> dict[str, Any]:
    return task_id.model_dump(mode="json")


def _generic_from_wire(wire: Any) -> Any:
    return TaskId.model_validate(wire)


def _plain() -> tuple[Callable[[Any], dict[str, Any]], Callable[[Any], Any]]:
    new, setattr_ = TaskId.__new__, object.__setattr__

    def to_wire(task_id: Any) -> dict[str, Any]:
        if type(task_id) is not TaskId:
            return task_id.model_dump(mode="json")
        fields = task_id.__dict__
        return {"taskset": fields["taskset"], "task_id": fields["task_id"]}

    def from_wire(wire: Any) -> Any:
        if type(wire) is dict and len(wire) == 2:
            taskset, task = wire.get("taskset"), wire.get("task_id")
            if type(taskset) is str and type(task) is str and taskset and task:
                made = new(TaskId)
                setattr_(made, "__dict__", {"taskset": taskset, "task_id": task})
                setattr_(made, "__pydantic_fields_set__", {"taskset", "task_id"})
                setattr_(made, "__pydantic_extra__", None)
                setattr_(made, "__pydantic_private__", None)
                return made
        return TaskId.model_validate(wire)

    return to_wire, from_wire


def _choose() -> tuple[Callable[[Any], dict[str, Any]], Callable[[Any], Any]]:
    """The plain pair when it gives what pydantic gives for this ``TaskId``, else pydantic's own."""
    to_wire, from_wire = _plain()
    try:
        decorators = TaskId.__pydantic_decorators__
        wire = {"taskset": "env:set", "task_id": "t-1"}
        made, validated = from_wire(dict(wire)), TaskId.model_validate(dict(wire))
        same = (
            tuple(TaskId.model_fields) == _FIELDS
            # Each a str of at least one character and nothing else (no pattern, no maximum, no alias).
            and all(
                f.annotation is str
                and f.alias is None
                and len(f.metadata) == 1
                and getattr(f.metadata[0], "min_length", None) == 1
                and type(f.metadata[0]).__name__ == "MinLen"
                for f in TaskId.model_fields.values()
            )
            # No coercion of its own (whitespace stripping, lower-casing...): only these two settings.
            and set(TaskId.model_config) <= {"extra", "frozen"}
            and TaskId.model_config.get("extra") == "forbid"
            and tuple(getattr(TaskId, "__slots__", ())) == _STATE
            and not TaskId.__pydantic_post_init__
            and not TaskId.__private_attributes__
            and not TaskId.model_computed_fields
            and not (decorators.validators or decorators.field_validators or decorators.root_validators)
            and not (decorators.field_serializers or decorators.model_serializers or decorators.model_validators)
            and all(getattr(made, name) == getattr(validated, name) for name in _STATE)
            and made == validated
            and hash(made) == hash(validated)
            and to_wire(validated) == validated.model_dump(mode="json") == wire
            and list(to_wire(validated)) == list(validated.model_dump(mode="json"))
        )
    except Exception:
        same = False
    return (to_wire, from_wire) if same else (_generic_to_wire, _generic_from_wire)


task_id_to_wire, task_id_from_wire = _choose()
