"""What ``collect`` prunes: the retention rule ``gc`` applies, narrowed to its own collection."""

from __future__ import annotations

from pathlib import Path

from nemo_gym_checkpoint_plugin._storage.index import write_participants_index
from nemo_gym_checkpoint_plugin._storage.retention import plan_retention
from nemo_gym_checkpoint_plugin.coordination._collector_state import CheckpointStore, CollectorState, RowState

OURS, THEIRS = "/x/out.jsonl", "/y/out.jsonl"


def _checkpoint(root: Path, seq: int, run: str, collection: str | None) -> Path:
    """``collect-<seq>-<run>`` in ``root``: published for ``collection``, or unpublished (None)."""
    store = CheckpointStore(root, run=run)
    checkpoint_id = store.checkpoint_id(seq)
    write_participants_index(store.path(checkpoint_id), checkpoint_id, [])
    state = CollectorState(
        checkpoint_id, {"participants": [], "output": collection or OURS}, [RowState("0-0", 0, "continued")]
    )
    digest, count = store.write_records(state)
    if collection is not None:
        store.publish(state, digest, count)
    return store.path(checkpoint_id)


def test_only_this_collections_checkpoints_go_and_the_newest_stay(tmp_path: Path) -> None:
    made = {
        1: _checkpoint(tmp_path, 1, "aaaaaaaa", OURS),
        2: _checkpoint(tmp_path, 2, "aaaaaaaa", None),  # a failed attempt of ours
        3: _checkpoint(tmp_path, 3, "bbbbbbbb", THEIRS),  # another collection's, older than our newest
        4: _checkpoint(tmp_path, 4, "cccccccc", None),  # unpublished, of a run we know nothing of
        5: _checkpoint(tmp_path, 5, "dddddddd", OURS),  # a predecessor's published checkpoint: its run is ours
        6: _checkpoint(tmp_path, 6, "dddddddd", None),
        7: _checkpoint(tmp_path, 7, "aaaaaaaa", OURS),
        8: _checkpoint(tmp_path, 8, "aaaaaaaa", None),  # being written now
    }
    store = CheckpointStore(tmp_path, run="aaaaaaaa", collection=OURS)
    assert sorted(p.name for p in store.prune(keep=2, in_use=[made[8]])) == [made[1].name, made[2].name, made[6].name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(made[n].name for n in (3, 4, 5, 7, 8))


def test_without_a_collection_the_rule_is_gcs(tmp_path: Path) -> None:
    for seq in (1, 2, 3):
        _checkpoint(tmp_path, seq, "aaaaaaaa", OURS)
    newer = _checkpoint(tmp_path, 4, "aaaaaaaa", None)
    plan = plan_retention(tmp_path, 2)
    # An unpublished checkpoint newer than the oldest kept is a write in progress for gc, which holds no lock.
    assert [c.name for c in plan.remove] == ["collect-000001-aaaaaaaa"] and newer.name in [
        c.name for c in plan.in_progress
    ]
    narrowed = plan_retention(tmp_path, 2, unpublished_failed=True, in_use=[str(newer)])
    assert [c.name for c in narrowed.remove] == ["collect-000001-aaaaaaaa"]
    assert [c.name for c in plan_retention(tmp_path, 2, unpublished_failed=True).remove] == [
        newer.name,
        "collect-000001-aaaaaaaa",
    ]


def test_a_link_named_like_a_checkpoint_is_never_this_collections(tmp_path: Path) -> None:
    theirs = tmp_path / "elsewhere"
    theirs.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    _checkpoint(root, 1, "aaaaaaaa", OURS)
    (root / "collect-000002-aaaaaaaa").symlink_to(theirs)
    assert CheckpointStore(root, run="aaaaaaaa", collection=OURS).prune(keep=1) == []
    assert (root / "collect-000002-aaaaaaaa").is_symlink()
