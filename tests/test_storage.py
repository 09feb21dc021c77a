from __future__ import annotations

import hashlib
import math
import threading
from pathlib import Path

import orjson
import pytest
from storage_support import record, write

from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState, WriteFailed
from nemo_gym_checkpoint_plugin._storage import CheckpointWriter, WriteStopped, load_manifest, read_checkpoint

PDIR = ("gym", "model", "policy_model")


def pdir(root: Path) -> Path:
    return root.joinpath(*PDIR)


def test_layout_and_manifest(tmp_path: Path) -> None:
    records = [record(f"r{i}", i % 2, step=i) for i in range(5)]
    manifest = write(tmp_path, records, extras={"generation": 3})
    files = sorted(p.name for p in pdir(tmp_path).iterdir())
    digest = hashlib.sha256((pdir(tmp_path) / manifest["records_file"]).read_bytes()).hexdigest()
    assert files == ["manifest.json", f"records-{digest}.jsonl"]
    on_disk = orjson.loads((pdir(tmp_path) / "manifest.json").read_bytes())
    assert (
        on_disk
        == manifest
        == {
            "schema_version": 1,
            "kind": "model",
            "instance": "policy_model",
            "checkpoint_id": "step-1",
            "records_file": f"records-{digest}.jsonl",
            "records_sha256": digest,
            "record_count": 5,
            "generation": 3,
        }
    )
    lines = (pdir(tmp_path) / manifest["records_file"]).read_bytes().splitlines()
    assert [orjson.loads(line) for line in lines] == records


def test_the_filesystem_writer_refuses_a_url_before_anything_is_written() -> None:
    # Its directory is a Path: an object-store URL is the object-store writer's (fsspec backend).
    with pytest.raises(WriteFailed, match="writes filesystem paths"):
        CheckpointWriter("s3://bucket/run", "model", "policy_model", "step-1")


def test_restore_keeps_only_scope_and_validates(tmp_path: Path) -> None:
    write(tmp_path, [record("a"), record("b", 2), record("c", 1)])
    seen = []
    result = read_checkpoint(tmp_path, "model", "policy_model", scope={"b-a2", "zzz"}, validate=seen.append)
    assert [r["episode_id"] for r in result.records] == [{"rollout_id": "b", "attempt": 2}]
    assert result.total == 3 and seen == result.records
    assert len(read_checkpoint(tmp_path, "model", "policy_model").records) == 3


def test_validation_failure_names_the_episode(tmp_path: Path) -> None:
    write(tmp_path, [record("a"), record("b", 1)])

    def refuse(rec: dict) -> None:
        raise ValueError("no step field")

    with pytest.raises(InvalidCheckpointState, match="episode b-a1 fails validation: no step field") as info:
        read_checkpoint(tmp_path, "model", "policy_model", scope={"b-a1"}, validate=refuse)
    assert info.value.data["episode"] == "b-a1"


def test_faithful_records_through_storage(tmp_path: Path) -> None:
    original = record("r", z=1, a=math.nan, b=-math.inf, big=2**80, nested={"y": 1, "x": 2})
    write(tmp_path, [original])
    (back,) = read_checkpoint(tmp_path, "model", "policy_model").records
    assert list(back) == list(original) and list(back["nested"]) == ["y", "x"]
    assert math.isnan(back["a"]) and back["b"] == -math.inf and back["big"] == 2**80


def test_not_json_fails_the_write_naming_the_episode(tmp_path: Path) -> None:
    import datetime

    with pytest.raises(InvalidCheckpointState, match="episode bad-a3 is not JSON: date is not a JSON value"):
        write(tmp_path, [record("ok"), record("bad", 3, when=datetime.date(2026, 1, 1))])
    assert not (pdir(tmp_path) / "manifest.json").exists()
    assert [p.name for p in pdir(tmp_path).iterdir()] == []


def test_record_without_episode_id_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidCheckpointState, match="episode_id"):
        write(tmp_path, [{"step": 1}])


def test_same_checkpoint_again_returns_its_manifest_other_is_refused(tmp_path: Path) -> None:
    first = write(tmp_path, [record("a")])
    assert write(tmp_path, [record("a")]) == first  # a retry of this very write
    with pytest.raises(InvalidCheckpointState, match="already holds checkpoint 'step-1'"):
        write(tmp_path, [record("a")], checkpoint_id="step-2")
    assert load_manifest(pdir(tmp_path)) == first
    assert sorted(p.name for p in pdir(tmp_path).iterdir()) == ["manifest.json", first["records_file"]]


def test_same_id_from_another_write_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    """A fresh process reusing the id (other records) is refused, saying why; the old checkpoint stays whole."""
    first = write(tmp_path, [record("a", v=1)])
    with pytest.raises(InvalidCheckpointState, match="from another write") as refused:
        write(tmp_path, [record("a", v=2), record("b")])
    assert not isinstance(refused.value, WriteFailed)
    assert "records_sha256" in refused.value.detail
    assert load_manifest(pdir(tmp_path)) == first
    assert sorted(p.name for p in pdir(tmp_path).iterdir()) == ["manifest.json", first["records_file"]]
    assert read_checkpoint(tmp_path, "model", "policy_model").records == [record("a", v=1)]


@pytest.mark.parametrize("same_records", [True, False])
def test_racing_writers_publish_exactly_once(tmp_path: Path, same_records: bool) -> None:
    """Racing writers of one id: exactly one publishes. Retries of the same export all get its manifest;
    writers of other records are refused."""
    barrier = threading.Barrier(4)
    results: list[dict | InvalidCheckpointState] = []

    def run(i: int) -> None:
        writer = CheckpointWriter(tmp_path, "model", "policy_model", "step-1")
        barrier.wait()
        name = "w" if same_records else f"w{i}"
        try:
            results.append(writer.write([record(f"{name}-{n}") for n in range(200)]))
        except InvalidCheckpointState as exc:
            results.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    published = load_manifest(pdir(tmp_path))
    won = [result for result in results if result == published]
    assert len(won) == (4 if same_records else 1)
    assert all(isinstance(result, InvalidCheckpointState) for result in results if result != published)
    # The losers' records files are gone; the published one verifies.
    assert sorted(p.name for p in pdir(tmp_path).iterdir()) == ["manifest.json", published["records_file"]]
    assert len(read_checkpoint(tmp_path, "model", "policy_model").records) == 200


def test_stop_before_next_record_publishes_nothing(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, "model", "policy_model", "step-1")
    produced = []

    def records():
        for i in range(100):
            if i == 10:
                assert writer.stop() is False
            produced.append(i)
            yield record(f"r{i}")

    with pytest.raises(WriteStopped):
        writer.write(records())
    assert produced == list(range(11))  # the generator ran once more, the writer did not write it
    assert not (pdir(tmp_path) / "manifest.json").exists()
    assert list(pdir(tmp_path).iterdir()) == []


def test_stop_after_publish_reports_published(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, "model", "policy_model", "step-1")
    writer.write([record("a")])
    assert writer.stop() is True
    assert (pdir(tmp_path) / "manifest.json").exists()


def test_stopped_writer_refuses_to_start(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, "model", "policy_model", "step-1")
    writer.stop()
    with pytest.raises(WriteStopped):
        writer.write([record("a")])
    assert not (tmp_path / "gym").exists()


# ---- bad input on restore: always invalid_checkpoint_state ------------------------------------


@pytest.fixture
def good(tmp_path: Path) -> Path:
    write(tmp_path, [record(f"r{i}", step=i) for i in range(3)])
    return tmp_path


def set_manifest(root: Path, body: bytes) -> None:
    path = pdir(root) / "manifest.json"
    path.unlink()
    path.write_bytes(body)


def edit_manifest(root: Path, **changes: object) -> None:
    manifest = orjson.loads((pdir(root) / "manifest.json").read_bytes())
    manifest.update(changes)
    for key, value in changes.items():
        if value is ...:
            del manifest[key]
    set_manifest(root, orjson.dumps(manifest))


def restore(root: Path) -> None:
    read_checkpoint(root, "model", "policy_model")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'"manifest"', "not a JSON object"),
    ],
)
def test_manifest_not_json_or_not_object(good: Path, body: bytes, message: str) -> None:
    set_manifest(good, body)
    with pytest.raises(InvalidCheckpointState, match=message):
        restore(good)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"records_sha256": ...}, "missing records_sha256"),
        ({"record_count": ..., "kind": ...}, "missing kind, record_count"),
        ({"schema_version": 2}, "schema_version 2"),
        ({"schema_version": "1"}, "schema_version"),
        ({"kind": "agent"}, "does not match"),
        ({"instance": "../x"}, "not a safe name"),
        ({"records_file": "../../records.jsonl"}, "not a records file name"),
        ({"records_file": "/etc/passwd"}, "not a records file name"),
        ({"records_sha256": "abc"}, "not a sha256"),
        ({"record_count": -1}, "non-negative"),
        ({"record_count": 2}, "holds 3 records, manifest says 2"),
        ({"records_sha256": "0" * 64}, "digest does not match"),
        ({"records_file": "records-" + "1" * 64 + ".jsonl"}, "is missing"),
    ],
)
def test_bad_manifest_fields(good: Path, changes: dict, message: str) -> None:
    edit_manifest(good, **changes)
    with pytest.raises(InvalidCheckpointState, match=message):
        restore(good)


def test_no_manifest_is_refused(good: Path) -> None:
    (pdir(good) / "manifest.json").unlink()
    with pytest.raises(InvalidCheckpointState, match="never published"):
        restore(good)


def test_missing_records_file(good: Path) -> None:
    manifest = load_manifest(pdir(good))
    (pdir(good) / manifest["records_file"]).unlink()
    with pytest.raises(InvalidCheckpointState, match="is missing"):
        restore(good)


def test_records_symlink_out_of_directory_is_refused(good: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    manifest = load_manifest(pdir(good))
    inside = pdir(good) / manifest["records_file"]
    outside = tmp_path_factory.mktemp("elsewhere") / "stolen.jsonl"
    outside.write_bytes(inside.read_bytes())
    inside.unlink()
    inside.symlink_to(outside)
    with pytest.raises(InvalidCheckpointState, match="outside the participant directory"):
        restore(good)


def test_truncated_last_line(good: Path) -> None:
    manifest = load_manifest(pdir(good))
    path = pdir(good) / manifest["records_file"]
    data = path.read_bytes()
    path.write_bytes(data[:-5])
    with pytest.raises(InvalidCheckpointState, match="truncated line"):
        restore(good)


def test_flipped_byte_fails_the_digest(good: Path) -> None:
    manifest = load_manifest(pdir(good))
    path = pdir(good) / manifest["records_file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(InvalidCheckpointState):
        restore(good)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"[1]\n", "not a JSON object"),
        (b'{"x": 1}\n', "no valid episode_id"),
        (b"{bad\n", "not JSON"),
        (b'{"episode_id": {"rollout_id": "r-a1", "attempt": 0}}\n', "no valid episode_id"),
    ],
)
def test_bad_record_in_a_digest_valid_file(tmp_path: Path, line: bytes, message: str) -> None:
    # A file whose digest and count match but whose content is not a valid record.
    directory = pdir(tmp_path)
    directory.mkdir(parents=True)
    digest = hashlib.sha256(line).hexdigest()
    (directory / f"records-{digest}.jsonl").write_bytes(line)
    (directory / "manifest.json").write_bytes(
        orjson.dumps(
            {
                "schema_version": 1,
                "kind": "model",
                "instance": "policy_model",
                "checkpoint_id": "c",
                "records_file": f"records-{digest}.jsonl",
                "records_sha256": digest,
                "record_count": 1,
            }
        )
    )
    with pytest.raises(InvalidCheckpointState, match=message):
        restore(tmp_path)


def test_directory_that_cannot_hold_state(tmp_path: Path) -> None:
    blocker = tmp_path / "gym"
    blocker.write_text("a file where a directory must be")
    with pytest.raises(InvalidCheckpointState, match="cannot hold checkpoint state"):
        write(tmp_path, [record("a")])


@pytest.mark.parametrize(("kind", "instance"), [("../model", "x"), ("model", "a/b"), ("", "x"), ("model", ".hidden")])
def test_unsafe_names_are_refused(tmp_path: Path, kind: str, instance: str) -> None:
    with pytest.raises(InvalidCheckpointState, match="safe path component"):
        write(tmp_path, [record("a")], kind=kind, instance=instance)
    with pytest.raises(InvalidCheckpointState, match="safe path component"):
        read_checkpoint(tmp_path, kind, instance)


def test_bad_checkpoint_id_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidCheckpointState, match="checkpoint id"):
        write(tmp_path, [record("a")], checkpoint_id="../up")


def test_racing_writers_of_different_checkpoints_one_wins_one_is_refused(tmp_path: Path) -> None:
    barrier = threading.Barrier(2)
    outcomes: dict[str, object] = {}

    def run(checkpoint_id: str) -> None:
        writer = CheckpointWriter(tmp_path, "model", "policy_model", checkpoint_id)
        barrier.wait()
        try:
            outcomes[checkpoint_id] = writer.write([record(f"{checkpoint_id}-{n}") for n in range(300)])
        except InvalidCheckpointState as exc:
            outcomes[checkpoint_id] = exc

    threads = [threading.Thread(target=run, args=(name,)) for name in ("one", "two")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    published = load_manifest(pdir(tmp_path))
    winner, loser = ("one", "two") if published["checkpoint_id"] == "one" else ("two", "one")
    assert outcomes[winner] == published
    assert isinstance(outcomes[loser], InvalidCheckpointState)
    assert [p.name for p in pdir(tmp_path).glob("records-*.jsonl")] == [published["records_file"]]


def test_big_integers_come_back_exactly_without_any_manifest_extra(tmp_path: Path) -> None:
    """No manifest extra steers decoding (an uncovered ``exact_lines`` could be edited to turn 2**70 into a
    float); every line is screened, whoever wrote it."""
    manifest = write(tmp_path, [record("a", n=1), record("b", big=2**70), record("c", x=math.inf)])
    assert "exact_lines" not in manifest
    # Editing the manifest to claim "no exact lines" (the old extra) changes nothing.
    path = pdir(tmp_path) / "manifest.json"
    path.write_bytes(orjson.dumps({**manifest, "exact_lines": 0}))
    back = read_checkpoint(tmp_path, "model", "policy_model").records
    assert back[1]["big"] == 2**70 and type(back[1]["big"]) is int and math.isinf(back[2]["x"])
    # Another writer's file (no extra at all) with a big integer that orjson would turn into a float.
    other = tmp_path / "other"
    directory = other / "gym" / "model" / "policy_model"
    directory.mkdir(parents=True)
    line = b'{"episode_id":{"rollout_id":"r","attempt":0},"big":123456789012345678901234567890}\n'
    digest = hashlib.sha256(line).hexdigest()
    (directory / f"records-{digest}.jsonl").write_bytes(line)
    (directory / "manifest.json").write_bytes(
        orjson.dumps(
            {
                "schema_version": 1,
                "kind": "model",
                "instance": "policy_model",
                "checkpoint_id": "c",
                "records_file": f"records-{digest}.jsonl",
                "records_sha256": digest,
                "record_count": 1,
            }
        )
    )
    (back,) = read_checkpoint(other, "model", "policy_model").records
    assert back["big"] == 123456789012345678901234567890 and type(back["big"]) is int
