"""A checkpoint root other users can write is refused (or used with a warning and every defence on)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_checkpoint_plugin._errors import WriteFailed
from nemo_gym_checkpoint_plugin._storage.writer import CheckpointWriter
from nemo_gym_checkpoint_plugin.cli import main
from nemo_gym_checkpoint_plugin.cli._collect_root import untrusted
from nemo_gym_checkpoint_plugin.coordination._collector_state import (
    CheckpointStore,
    deployment_identity,
    identity_mismatch,
)

NOBODY = 65534
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")


def _dir(path: Path, mode: int) -> Path:
    path.mkdir()
    os.chmod(path, mode)  # exactly, whatever the umask
    return path


def test_a_directory_only_this_user_can_write_is_trusted(tmp_path: Path) -> None:
    assert untrusted(_dir(tmp_path / "mine", 0o700)) is None
    assert untrusted(tmp_path / "mine" / "not-yet") is None


def test_a_directory_others_can_write_is_not(tmp_path: Path) -> None:
    assert untrusted(_dir(tmp_path / "scratch", 0o777)) == (
        f"{tmp_path / 'scratch'} is writable by its group and every user (mode 0777)"
    )
    # Below a parent others can write (no sticky bit), the root itself can be replaced.
    shared = _dir(tmp_path / "shared", 0o777)
    problem = untrusted(_dir(shared / "ckpt", 0o700))
    assert problem is not None and f"{shared} (above it) is writable" in problem
    # A sticky parent (like /tmp) lets nobody replace this user's own entry.
    sticky = _dir(tmp_path / "sticky", 0o1777)
    assert untrusted(_dir(sticky / "ckpt", 0o700)) is None
    assert untrusted(sticky / "not-yet") is None
    # A link is judged by where it leads.
    (tmp_path / "link").symlink_to(tmp_path / "scratch")
    assert "writable by its group and every user" in (untrusted(tmp_path / "link") or "")


@needs_root
def test_a_directory_of_another_user_is_not(tmp_path: Path) -> None:
    theirs = _dir(tmp_path / "theirs", 0o700)
    os.chown(theirs, NOBODY, NOBODY)
    assert untrusted(theirs) == f"{theirs} belongs to another user (uid {NOBODY})"
    sticky = _dir(tmp_path / "sticky", 0o1777)
    planted = _dir(sticky / "ckpt", 0o700)
    os.chown(planted, NOBODY, NOBODY)  # made first by another user in a sticky directory
    assert "belongs to another user" in (untrusted(planted) or "")


def test_collect_refuses_a_shared_root_before_touching_it(tmp_path: Path, capsys: Any) -> None:
    scratch = _dir(tmp_path / "scratch", 0o777)
    assert main(["collect", "--checkpoint-dir", str(scratch)]) == 2
    err = capsys.readouterr().err
    assert f"--checkpoint-dir {scratch} is not safe: {scratch} is writable by its group and every user" in err
    assert "pass --allow-shared-root to use it anyway" in err
    assert list(scratch.iterdir()) == []  # no lock, nothing


def test_nothing_below_a_checkpoint_directory_is_written_through_a_link(tmp_path: Path) -> None:
    checkpoint, elsewhere = tmp_path / "ckpt", _dir(tmp_path / "elsewhere", 0o700)
    checkpoint.mkdir()
    (checkpoint / "gym").symlink_to(elsewhere)  # planted where the writer makes gym/
    with pytest.raises(WriteFailed, match="a symbolic link where a directory must be"):
        CheckpointWriter(checkpoint, "environment", "env", "c1").write(
            [{"episode_id": {"rollout_id": "r", "attempt": 0}}]
        )
    assert list(elsewhere.iterdir()) == []


def test_a_checkpoint_directory_is_made_exclusively(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    (tmp_path / store.checkpoint_id(3)).symlink_to(_dir(tmp_path / "theirs", 0o700))
    with pytest.raises(Exception, match="exists already, and this collector did not make it"):
        store.create(store.checkpoint_id(3))
    assert (store.create(store.checkpoint_id(4)).stat().st_mode & 0o777) == 0o700


def test_a_resume_refuses_a_checkpoint_of_another_input() -> None:
    from types import SimpleNamespace

    env = [SimpleNamespace(kind="environment", instance="env")]
    recorded = deployment_identity(env, "/x/out.jsonl", "/x/in.jsonl")
    assert identity_mismatch(recorded, deployment_identity(env, "/x/out.jsonl", "/x/in.jsonl")) is None
    why = identity_mismatch(recorded, deployment_identity(env, "/x/out.jsonl", "/y/other-in.jsonl"))
    assert why == "it collected /x/in.jsonl, this run /y/other-in.jsonl"
    # A checkpoint written before inputs were recorded is judged by the rest.
    assert (
        identity_mismatch(
            deployment_identity(env, "/x/out.jsonl"), deployment_identity(env, "/x/out.jsonl", "/y/in.jsonl")
        )
        is None
    )


@needs_root
def test_a_resume_never_chooses_a_checkpoint_another_user_wrote(tmp_path: Path) -> None:
    from nemo_gym_checkpoint_plugin._storage.index import write_participants_index
    from nemo_gym_checkpoint_plugin.coordination._collector_state import COLLECTOR_DIR, CollectorState, RowState

    store = CheckpointStore(tmp_path / "ckpt")
    for seq in (1, 999999):
        checkpoint_id = store.checkpoint_id(seq)
        write_participants_index(store.path(checkpoint_id), checkpoint_id, [])
        state = CollectorState(
            checkpoint_id,
            {"participants": [], "output": "/x/out.jsonl"},
            [RowState("0-0", 0, "continued")] if seq == 1 else [],
        )
        store.publish(state, *store.write_records(state))
    # The newest one, self-consistent, was planted by another user (it holds no rows: all progress gone).
    planted = store.path(store.checkpoint_id(999999))
    for path in (planted, *planted.rglob("*")):
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
    state, skipped = store.latest()
    assert state is not None and state.checkpoint_id == store.checkpoint_id(1)
    assert skipped == [
        (
            planted.name,
            f"{planted / COLLECTOR_DIR}: manifest.json belongs to another user (uid {NOBODY}), not to this collector's",
        )
    ]
