"""``commit --all``'s scope from the participants' status (the pure rule; real processes: test_cli_restarts)."""

from __future__ import annotations

import pytest

from nemo_gym_checkpoint_plugin.cli._scope import commit_all_scope
from nemo_gym_checkpoint_plugin.cli._where import UsageError


def _status(kind: str, restarts=(), **fields):
    return {"kind": kind, "report": {"ready": True, "restarts": list(restarts)}, **fields}


def test_without_restarts_the_scope_is_everything():
    statuses = {"env": _status("environment", episode_keys=["a", "b"]), "agent": _status("agent")}
    assert commit_all_scope(statuses) == (None, [])


def test_every_restart_any_participant_reported_is_left_out():
    statuses = {
        "env": _status("environment", restarts=["r"], episode_keys=["a", "r", "b-a1"]),
        "env2": _status("environment", episode_keys=["c", "x"]),
        "res": _status("resources", restarts=["x"]),  # reported by another participant only
        "agent": _status("agent"),
    }
    assert commit_all_scope(statuses) == (["a", "b-a1", "c"], ["r", "x"])


@pytest.mark.parametrize(
    "statuses",
    [
        {"agent": _status("agent", restarts=["r"])},  # no environment at all
        {"env": _status("environment", restarts=["r"])},  # an environment that does not list its episodes
    ],
)
def test_restarts_with_unknown_episodes_ask_for_an_explicit_scope(statuses):
    with pytest.raises(UsageError, match=r"commit --all must leave out 1 restart\(s\) \(r\).*--episode"):
        commit_all_scope(statuses)
