"""The retention rule: which collection checkpoints may go (``coordination._retention``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_gym_checkpoint_plugin.coordination._retention import CheckpointEntry, checkpoints_to_remove

OURS, THEIRS = "/x/out.jsonl", "/y/out.jsonl"


def _entry(seq: int, run: str, published: bool, collection: str | None = None) -> CheckpointEntry:
    return CheckpointEntry(seq, run, Path(f"/ckpt/collect-{seq:06d}-{run}"), published,
                           collection if published else None)


def test_only_this_collections_checkpoints_go_and_the_newest_stay() -> None:
    entries = [
        _entry(1, "aaaaaaaa", True, OURS),
        _entry(2, "aaaaaaaa", False),  # a failed attempt of ours
        _entry(3, "bbbbbbbb", True, THEIRS),  # another collection's, older than our newest
        _entry(4, "cccccccc", False),  # an unpublished checkpoint of a run we know nothing of
        _entry(5, "dddddddd", True, OURS),  # a predecessor's published checkpoint: its run is ours
        _entry(6, "dddddddd", False),
        _entry(7, "aaaaaaaa", True, OURS),
        _entry(8, "aaaaaaaa", False),  # being written now
    ]
    removed = checkpoints_to_remove(entries, keep=2, collection=OURS, runs={"aaaaaaaa"},
                                    in_use=[entries[7].path])
    assert [p.name for p in removed] == ["collect-000001-aaaaaaaa", "collect-000002-aaaaaaaa",
                                         "collect-000006-dddddddd"]


def test_a_checkpoint_in_use_is_kept_whatever_its_age() -> None:
    entries = [_entry(seq, "aaaaaaaa", True, OURS) for seq in (1, 2, 3)]
    assert checkpoints_to_remove(entries, keep=1, collection=OURS, runs=(), in_use=[entries[0].path]) == [
        entries[1].path]


def test_keep_must_be_positive() -> None:
    with pytest.raises(ValueError, match="keep"):
        checkpoints_to_remove([], keep=0, collection=OURS, runs=())
