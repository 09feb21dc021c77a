"""A plugin module published through the ``nemo_gym_checkpoint`` entry-point group in one test."""

from __future__ import annotations

from nemo_gym_checkpoint_plugin._markers import hookimpl


@hookimpl
def status_fields() -> dict[str, bool]:
    return {"from_entry_point": True}
