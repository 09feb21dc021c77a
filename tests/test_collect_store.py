"""The collector's own checkpoint state on disk, and what ``ng-checkpoint collect`` refuses before anything runs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState
from nemo_gym_checkpoint_plugin._storage.index import write_participants_index
from nemo_gym_checkpoint_plugin.cli import main
from nemo_gym_checkpoint_plugin.coordination._collector_state import (
    COLLECTOR_DIR,
    CheckpointStore,
    CollectorState,
    RowState,
    deployment_identity,
    identity_mismatch,
)

IDENTITY = {"participants": ["environment/env"], "output": "/x/out.jsonl"}


def _publish(store: CheckpointStore, seq: int, *, publish: bool = True) -> Path:
    checkpoint_id = store.checkpoint_id(seq)
    write_participants_index(store.path(checkpoint_id), checkpoint_id, [])
    state = CollectorState(
        checkpoint_id,
        IDENTITY,
        [RowState("0-0", 0, "continued"), RowState("1-0", 2, "restart")],
        finished={"rows": seq, "output": "/x/out.jsonl", "output_bytes": 10 * seq},
    )
    digest, count = store.write_records(state)
    if publish:
        store.publish(state, digest, count)
    return store.path(checkpoint_id)


def test_state_is_published_manifest_last_and_read_back(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    checkpoint_id = store.checkpoint_id(1)
    write_participants_index(store.path(checkpoint_id), checkpoint_id, [])
    state = CollectorState(checkpoint_id, IDENTITY, [RowState("0-0", 0, "continued"), RowState("1-0", 2, "restart")])
    digest, count = store.write_records(state)
    assert store.published() == [] and store.latest() == (None, [])  # records alone are not a checkpoint
    store.publish(state, digest, count)
    read, skipped = store.latest()
    assert skipped == [] and read is not None and read.checkpoint_id == checkpoint_id
    assert [(r.rollout_id, r.attempt, r.state) for r in read.rows] == [("0-0", 0, "continued"), ("1-0", 2, "restart")]
    assert read.deployment == IDENTITY
    path = store.path(checkpoint_id) / COLLECTOR_DIR
    modes = {p.name: p.stat().st_mode & 0o777 for p in path.iterdir()}
    assert set(modes.values()) == {0o600} and "manifest.json" in modes


def test_older_checkpoints_go_only_after_a_newer_one_is_published(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt", collection="/x/out.jsonl")
    for seq in (1, 2, 3):
        _publish(store, seq)
    unpublished = _publish(store, 4, publish=False)
    assert [p.name for p in store.prune(keep=2, in_use=[unpublished])] == [store.checkpoint_id(1)]
    assert [seq for seq, _ in store.entries()] == [2, 3, 4]  # the write in progress (4) is never removed
    assert unpublished.exists() and store.next_seq() == 5
    # Once it is no longer in use, an unpublished attempt is a failed one: it goes.
    assert store.prune(keep=2) == [unpublished] and [seq for seq, _ in store.entries()] == [2, 3]


def test_prune_never_touches_another_runs_checkpoints(tmp_path: Path) -> None:
    other = CheckpointStore(tmp_path / "ckpt", run="0badc0de", collection="/y/other.jsonl")
    theirs = [_publish(other, 1), _publish(other, 2, publish=False)]
    # The other collection's manifest names its own output.
    manifest = json.loads((theirs[0] / COLLECTOR_DIR / "manifest.json").read_text())
    manifest["collector"]["deployment"]["output"] = "/y/other.jsonl"
    os.chmod(theirs[0] / COLLECTOR_DIR / "manifest.json", 0o600)
    (theirs[0] / COLLECTOR_DIR / "manifest.json").write_text(json.dumps(manifest))
    store = CheckpointStore(tmp_path / "ckpt", collection="/x/out.jsonl")
    ours = [_publish(store, seq) for seq in (3, 4, 5)]
    assert store.prune(keep=1) == ours[:2]
    assert all(path.exists() for path in theirs) and ours[2].exists()


def test_a_corrupted_last_checkpoint_falls_back_to_the_one_before(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    _publish(store, 1)
    newest = _publish(store, 2)
    (records,) = (newest / COLLECTOR_DIR).glob("records-*.jsonl")
    records.write_bytes(records.read_bytes().replace(b'"restart"', b'"continu"'))
    state, skipped = store.latest()
    assert state is not None and state.checkpoint_id == store.checkpoint_id(1)
    assert skipped and skipped[0][0] == newest.name and "digest" in skipped[0][1]


def test_a_checkpoint_of_another_deployment_is_named_as_such() -> None:
    here = deployment_identity([SimpleNamespace(kind="environment", instance="env2")], "/x/out.jsonl")
    why = identity_mismatch(IDENTITY, here)
    assert why is not None and "environment/env2" in why
    assert (
        identity_mismatch(
            IDENTITY, deployment_identity([SimpleNamespace(kind="environment", instance="env")], "/x/out.jsonl")
        )
        is None
    )


@pytest.mark.parametrize(
    ("where", "says"),
    [
        ("relative/ckpt", "is relative"),
        ("{tmp}/missing/ckpt", "its parent {tmp}/missing does not exist"),
        ("/proc/ng-checkpoint-test", "/proc is not writable"),
        ("{tmp}/file", "exists and is not a directory"),
    ],
)
def test_a_bad_checkpoint_dir_is_refused_before_anything_runs(
    tmp_path: Path, capsys: Any, where: str, says: str
) -> None:
    (tmp_path / "file").write_text("x")
    # No Gym configuration at all: the directory is refused before it would be read.
    status = main(["collect", "--checkpoint-dir", where.format(tmp=tmp_path)])
    assert status == 2
    assert says.format(tmp=tmp_path) in capsys.readouterr().err


def test_a_fresh_collection_refuses_a_directory_holding_an_earlier_one(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # Gym's parser (Hydra) writes outputs/ in the working directory
    monkeypatch.setenv("NG_CHECKPOINT_TOKEN", "collect-store-token")
    store = CheckpointStore(tmp_path / "ckpt")
    _publish(store, 1)
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("")
    status = main(
        [
            "collect",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            f"+input_jsonl_fpath={inputs}",
            f"+output_jsonl_fpath={tmp_path / 'out.jsonl'}",
        ]
    )
    assert status == 2
    assert "holds checkpoints of an earlier collection; pass --resume" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_unreadable_state_is_refused_naming_it(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    path = _publish(store, 1)
    manifest = json.loads((path / COLLECTOR_DIR / "manifest.json").read_text())
    assert manifest["kind"] == "collector" and manifest["collector"]["finished"]["output_bytes"] == 10
    os.unlink(path / "gym" / "participants.json")
    with pytest.raises(InvalidCheckpointState, match="participants.json"):
        store.read(path)
