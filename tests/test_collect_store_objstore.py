"""``ng-checkpoint collect --checkpoint-dir s3://...``: the collector's state in the local S3 server."""

from __future__ import annotations

from typing import Any

import pytest

from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState
from nemo_gym_checkpoint_plugin._storage import objstore
from nemo_gym_checkpoint_plugin._storage.index import write_participants_index
from nemo_gym_checkpoint_plugin._storage.objstore import ObjectPath
from nemo_gym_checkpoint_plugin.cli import main
from nemo_gym_checkpoint_plugin.coordination._collector_state import (
    COLLECTOR_DIR,
    CheckpointStore,
    CollectorState,
    RowState,
)

IDENTITY = {"participants": ["environment/env"], "output": "/x/out.jsonl"}


def publish(store: CheckpointStore, seq: int, *, published: bool = True) -> ObjectPath:
    checkpoint_id = store.checkpoint_id(seq)
    write_participants_index(store.path(checkpoint_id), checkpoint_id, [])
    state = CollectorState(
        checkpoint_id,
        IDENTITY,
        [RowState("0-0", 0, "continued"), RowState("1-0", 2, "restart")],
        finished={"rows": seq, "output": "/x/out.jsonl", "output_bytes": 10 * seq},
    )
    digest, count = store.write_records(state)
    if published:
        store.publish(state, digest, count)
    path = store.path(checkpoint_id)
    assert isinstance(path, ObjectPath)
    return path


def objects(path: ObjectPath) -> list[str]:
    return sorted(name[len(path.native) + 1 :] for name in objstore.filesystem("s3").find(path.native))


def test_state_in_s3_is_published_manifest_last_and_read_back(s3_dir: str) -> None:
    store = CheckpointStore(s3_dir)
    path = publish(store, 1, published=False)
    assert store.published() == [] and store.latest() == (None, [])  # records alone are not a checkpoint
    records = [name for name in objects(path) if name.startswith(f"{COLLECTOR_DIR}/records-")]
    assert len(records) == 1 and objects(path) == [records[0], "gym/participants.json"]
    publish(store, 1)  # the same state again: the same digest-named records, then the manifest
    state, skipped = store.latest()
    assert skipped == [] and state is not None and state.checkpoint_id == store.checkpoint_id(1)
    assert [(r.rollout_id, r.attempt, r.state) for r in state.rows] == [("0-0", 0, "continued"), ("1-0", 2, "restart")]
    assert state.path == path and objects(path) == [
        f"{COLLECTOR_DIR}/manifest.json",
        records[0],
        "gym/participants.json",
    ]


def test_a_second_publish_of_one_checkpoint_is_refused(s3_dir: str) -> None:
    store = CheckpointStore(s3_dir)
    publish(store, 1)
    with pytest.raises(InvalidCheckpointState, match="cannot publish the collector state: already exists"):
        publish(store, 1)


def test_older_checkpoints_in_s3_go_only_after_a_newer_one_is_published(s3_dir: str) -> None:
    store = CheckpointStore(s3_dir)
    for seq in (1, 2, 3):
        publish(store, seq)
    publish(store, 4, published=False)
    assert [p.name for p in store.prune(keep=2)] == [store.checkpoint_id(1)]
    assert [seq for seq, _ in store.entries()] == [2, 3, 4]  # the write in progress (4) is never removed
    assert store.next_seq() == 5


def test_a_tampered_newest_checkpoint_in_s3_falls_back_to_the_one_before(s3_dir: str) -> None:
    store = CheckpointStore(s3_dir)
    publish(store, 1)
    newest = publish(store, 2)
    fs = objstore.filesystem("s3")
    (records,) = [name for name in objects(newest) if name.startswith(f"{COLLECTOR_DIR}/records-")]
    key = f"{newest.native}/{records}"
    fs.pipe_file(key, fs.cat_file(key).replace(b'"restart"', b'"continu"'))
    state, skipped = store.latest()
    assert state is not None and state.checkpoint_id == store.checkpoint_id(1)
    assert skipped and skipped[0][0] == newest.name and "digest" in skipped[0][1]


def test_collect_refuses_a_store_that_accepts_a_second_exclusive_create_before_anything_runs(
    lenient_store: str,
    capsys: Any,
) -> None:
    # No Gym configuration at all: the store is refused before it would be read.
    assert main(["collect", "--checkpoint-dir", lenient_store]) == 2
    assert "accepted a second exclusive create of one object" in capsys.readouterr().err


def test_collect_refuses_a_url_with_credentials_without_repeating_it(capsys: Any) -> None:
    assert main(["collect", "--checkpoint-dir", "s3://AKIAEXAMPLE:verysecretvalue@bucket/run"]) == 2
    err = capsys.readouterr().err
    assert "must not carry credentials" in err and "verysecretvalue" not in err
