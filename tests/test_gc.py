"""``ng-checkpoint gc DIR --keep K`` and the retention rule it shares with ``collect --keep``.

On a local directory and on a prefix of the session's S3 server alike: the K newest published
checkpoints stay, and so does any a commit or restore holds a live lease on, and a write in
progress; older published ones and abandoned writes go, only with ``--yes``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import orjson
import pytest

from nemo_gym_checkpoint_plugin._storage.index import write_participants_index
from nemo_gym_checkpoint_plugin._storage.location import child_dirs, lexists, location
from nemo_gym_checkpoint_plugin._storage.retention import LEASE_DIR, hold_lease, plan_retention
from nemo_gym_checkpoint_plugin.cli import main
from nemo_gym_checkpoint_plugin.coordination._collector_state import CheckpointStore, CollectorState, RowState

IDENTITY = {"participants": [], "output": "/x/out.jsonl"}


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "ckpt")
    return request.getfixturevalue("s3_dir")


def collect_checkpoint(store: CheckpointStore, seq: int, *, published: bool = True) -> str:
    checkpoint_id = store.checkpoint_id(seq)
    write_participants_index(store.path(checkpoint_id), checkpoint_id, [])
    state = CollectorState(checkpoint_id, IDENTITY, [RowState("0-0", 0, "continued")])
    digest, count = store.write_records(state)
    if published:
        store.publish(state, digest, count)
    return checkpoint_id


def names(root: str) -> list[str]:
    return child_dirs(location(root))


def gc(root: str, *args: str, capsys: pytest.CaptureFixture) -> tuple[int, dict]:
    status = main(["gc", "--json", root, *args])
    return status, orjson.loads(capsys.readouterr().out)


def test_gc_keeps_the_newest_removes_older_and_abandoned_only_with_yes(root: str, capsys) -> None:  # noqa: ANN001
    store = CheckpointStore(root)
    ids = [collect_checkpoint(store, seq, published=seq != 2) for seq in (1, 2, 3, 4, 5)]
    in_progress = collect_checkpoint(store, 6, published=False)
    status, dry = gc(root, "--keep", "2", capsys=capsys)
    assert status == 0 and dry["dry_run"] is True and dry["removed"] == []
    actions = {row["name"]: (row["action"], row["why"]) for row in dry["checkpoints"]}
    assert actions == {
        in_progress: ("keep", "a write in progress (newer than the oldest kept, not published)"),
        ids[4]: ("keep", "one of the 2 newest published"),
        ids[3]: ("keep", "one of the 2 newest published"),
        ids[2]: ("remove", "older than the newest kept"),
        ids[1]: ("remove", "an abandoned write"),
        ids[0]: ("remove", "older than the newest kept"),
    }
    assert [row["name"] for row in dry["checkpoints"]] == [in_progress, *reversed(ids)]  # newest first
    assert names(root) == sorted([*ids, in_progress])  # a dry run removes nothing
    status, done = gc(root, "--keep", "2", "--yes", capsys=capsys)
    assert status == 0 and sorted(done["removed"]) == sorted(ids[:3])
    assert names(root) == sorted([ids[3], ids[4], in_progress])
    assert store.latest()[0].checkpoint_id == ids[4]


def test_a_checkpoint_under_a_live_lease_is_never_removed(root: str, capsys) -> None:  # noqa: ANN001
    store = CheckpointStore(root)
    ids = [collect_checkpoint(store, seq) for seq in (1, 2, 3)]
    # A restore from the oldest one is running (its deadline in a minute).
    with hold_lease(store.path(ids[0]), "restore", "restore-1", time.time() + 60):
        status, done = gc(root, "--keep", "1", "--yes", capsys=capsys)
        assert status == 0 and done["removed"] == [ids[1]]
        (row,) = [r for r in done["checkpoints"] if r["name"] == ids[0]]
        assert row["action"] == "keep" and row["why"].startswith("in use: restore of restore-1 by pid ")
    assert not names(location(store.path(ids[0])) / LEASE_DIR)  # the lease went with the restore
    status, done = gc(root, "--keep", "1", "--yes", capsys=capsys)
    assert done["removed"] == [ids[0]] and names(root) == [ids[2]]


def write_lease(checkpoint: str, **fields: object) -> None:
    body = {
        "schema_version": 1,
        "operation": "commit",
        "checkpoint_id": "x",
        "holder": "0" * 32,
        "host": "elsewhere",
        "pid": 1,
        "expires_at": time.time() + 600,
        **fields,
    }
    where = location(checkpoint) / LEASE_DIR / f"{'0' * 32}.json"
    if isinstance(where, Path):
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_bytes(orjson.dumps(body) if fields.get("raw") is None else fields["raw"])  # type: ignore[arg-type]
    else:
        where.fs.pipe_file(where.native, orjson.dumps(body) if fields.get("raw") is None else fields["raw"])


@pytest.mark.parametrize(
    ("fields", "protects"),
    [
        ({}, True),  # another host's live lease
        ({"expires_at": time.time() - 1}, False),  # expired: its controller is gone
        ({"host": os.uname().nodename, "pid": 2**22 + 11}, False),  # this host, its process dead
        ({"raw": b"{not json"}, True),  # cannot be read: never removed on a guess
    ],
)
def test_which_leases_protect_a_checkpoint(root: str, fields: dict, protects: bool) -> None:
    store = CheckpointStore(root)
    ids = [collect_checkpoint(store, seq) for seq in (1, 2)]
    write_lease(str(store.path(ids[0])), **fields)
    plan = plan_retention(root, 1)
    assert [c.name for c in plan.in_use] == ([ids[0]] if protects else [])
    assert [c.name for c in plan.remove] == ([] if protects else [ids[0]])


def test_without_collect_names_checkpoints_are_ordered_by_publish_time(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    root = tmp_path / "run"
    for index, name in enumerate(["zeta", "alpha", "mid"]):  # published in this order
        write_participants_index(root / name, name, [])
        stamp = 1_700_000_000 + index * 60
        os.utime(root / name / "gym" / "participants.json", (stamp, stamp))
    status, dry = gc(str(root), "--keep", "1", capsys=capsys)
    assert status == 0
    assert [(r["name"], r["action"]) for r in dry["checkpoints"]] == [
        ("mid", "keep"),
        ("alpha", "remove"),
        ("zeta", "remove"),
    ]


def test_a_removal_cut_short_leaves_an_unpublished_checkpoint_the_next_gc_removes(root: str, capsys) -> None:  # noqa: ANN001
    store = CheckpointStore(root)
    ids = [collect_checkpoint(store, seq) for seq in (1, 2)]
    # What a gc killed right after taking the publish marker leaves behind: the rest of the files.
    marker = location(store.path(ids[0])) / "collector" / "manifest.json"
    if isinstance(marker, Path):
        marker.unlink()
    else:
        marker.fs.rm_file(marker.native)
    assert [seq for seq, _ in store.published()] == [2]
    status, done = gc(root, "--keep", "1", "--yes", capsys=capsys)
    assert done["removed"] == [ids[0]] and not lexists(location(store.path(ids[0])))


def test_gc_refuses_a_checkpoint_itself_and_a_missing_directory(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    write_participants_index(tmp_path / "one", "one", [])
    assert main(["gc", str(tmp_path / "one"), "--keep", "1"]) == 2
    assert "is a checkpoint itself" in capsys.readouterr().err
    assert main(["gc", str(tmp_path / "missing"), "--keep", "1"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["gc", str(tmp_path), "--keep", "1"]) == 0
    assert "dry run: 0 checkpoint(s) would be removed" in capsys.readouterr().out


def test_a_lease_never_makes_a_checkpoint_directory(tmp_path: Path) -> None:
    # The servers make a commit's directory, as the user they run as; the controller only leases one that exists.
    with hold_lease(tmp_path / "new", "commit", "step-1", time.time() + 60):
        assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    with hold_lease(tmp_path / "old", "restore", "r-1", time.time() + 60):
        (lease,) = (tmp_path / "old" / LEASE_DIR).iterdir()
        assert lease.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == []  # the lease and its directory gone


def test_collect_keep_prunes_by_the_same_rule_and_respects_leases(root: str) -> None:
    store = CheckpointStore(root)
    ids = {seq: collect_checkpoint(store, seq, published=seq != 2) for seq in (1, 2, 3, 4, 5)}
    with hold_lease(store.path(ids[1]), "restore", "restore-1", time.time() + 60):
        removed = sorted(location(path).name for path in store.prune(keep=2))
    # The same plan gc makes: the oldest kept because a restore reads it, the abandoned write (2) removed.
    assert removed == sorted([ids[2], ids[3]])
    assert names(root) == sorted([ids[1], ids[4], ids[5]])


def test_a_lease_that_cannot_be_written_leaves_no_file_that_would_protect_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full disk: the lease file is created, its write fails. An empty lease reads as unreadable,
    # which protects a checkpoint for good: the failed attempt could then never be removed.
    import errno
    from contextlib import contextmanager

    from nemo_gym_checkpoint_plugin._storage import files

    real = files.create_private

    @contextmanager
    def full_disk(path, buffering=-1):  # noqa: ANN001, ANN202
        with real(path, buffering):
            pass
        raise OSError(errno.ENOSPC, "No space left on device")
        yield  # pragma: no cover

    monkeypatch.setattr(files, "create_private", full_disk)
    checkpoint = tmp_path / "ckpt" / "collect-000002-0badc0de"
    (checkpoint / "gym").mkdir(parents=True)
    with hold_lease(checkpoint, "commit", "collect-000002-0badc0de", time.time() + 60):
        assert list((checkpoint / LEASE_DIR).iterdir()) == []
    assert [c.name for c in plan_retention(tmp_path / "ckpt", 1, unpublished_failed=True).remove] == [checkpoint.name]
