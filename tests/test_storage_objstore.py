"""The ``fsspec`` storage backend on a real S3-compatible server (moto's server mode on 127.0.0.1).

Same guarantees as the local backend: records streamed under their digest name, verified on
read; the manifest created exclusively as the commit point; a second exclusive create refused;
a store that does not refuse one refused before anything is written; tampered, partial or
missing objects refused by name; a restore that holds two read blocks at most.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from storage_support import LenientMemoryFileSystem, record

from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState, WriteFailed
from nemo_gym_checkpoint_plugin._plugins import get_storage_backend, make_plugin_manager
from nemo_gym_checkpoint_plugin._settings import StorageSettings
from nemo_gym_checkpoint_plugin._storage import objstore
from nemo_gym_checkpoint_plugin._storage.objstore import ObjectPath, StoreUnsafe
from nemo_gym_checkpoint_plugin._storage.objstore_put import UPLOAD_PART, create_exclusive

KIND, INSTANCE = "model", "policy_model"


def backend(**settings):  # noqa: ANN003, ANN201
    return get_storage_backend(
        make_plugin_manager(load_entry_points=False), StorageSettings(backend="fsspec", **settings)
    )


def s3() -> fsspec.AbstractFileSystem:
    return objstore.filesystem("s3")


def keys(url: str) -> list[str]:
    """Every object under ``url``, relative to it."""
    prefix = ObjectPath(url).native
    return sorted(name[len(prefix) + 1 :] for name in s3().find(prefix))


def write(url: str, records: list[dict], checkpoint_id: str = "step-1", **extras) -> dict:  # noqa: ANN003
    return backend().open_writer(url, KIND, INSTANCE, checkpoint_id).write(records, extras or None)


def test_round_trip_writes_digest_named_records_and_a_manifest_only(s3_dir: str) -> None:
    records = [
        record(f"r{i}", i % 3, blob="x" * 1000, nan=float("nan"), big=2**70, order={"z": 1, "a": 2}) for i in range(50)
    ]
    manifest = write(s3_dir, records, extra_field={"kept": True})
    assert manifest["records_file"] == f"records-{manifest['records_sha256']}.jsonl"
    assert manifest["record_count"] == 50 and manifest["extra_field"] == {"kept": True}
    # No temporary name, no probe object: the digest-named records and the manifest, nothing else.
    assert keys(s3_dir) == [f"gym/{KIND}/{INSTANCE}/manifest.json", f"gym/{KIND}/{INSTANCE}/{manifest['records_file']}"]
    restored = backend().read(s3_dir, KIND, INSTANCE, scope={"r1-a1", "r4-a1"})
    assert restored.total == 50 and [r["episode_id"]["rollout_id"] for r in restored.records] == ["r1", "r4"]
    again = backend().read(s3_dir, KIND, INSTANCE).records
    assert again[7]["big"] == 2**70 and list(again[7]["order"]) == ["z", "a"] and again[7]["nan"] != again[7]["nan"]
    assert backend().read_manifest(s3_dir, KIND, INSTANCE) == manifest


def test_a_retry_returns_the_published_manifest_and_another_write_is_refused(s3_dir: str) -> None:
    manifest = write(s3_dir, [record("a")])
    assert write(s3_dir, [record("a")]) == manifest
    with pytest.raises(InvalidCheckpointState, match="from another write"):
        write(s3_dir, [record("b")])
    with pytest.raises(InvalidCheckpointState, match="already holds checkpoint 'step-1'; refusing to commit 'step-2'"):
        write(s3_dir, [record("c")], checkpoint_id="step-2")
    # Neither refused write left its records behind.
    assert keys(s3_dir) == [f"gym/{KIND}/{INSTANCE}/manifest.json", f"gym/{KIND}/{INSTANCE}/{manifest['records_file']}"]


def test_the_store_refuses_a_second_exclusive_create(s3_dir: str) -> None:
    target = ObjectPath(s3_dir) / "commit-point.json"
    assert create_exclusive(target, b"first\n") is True
    assert create_exclusive(target, b"second\n") is False
    assert s3().cat_file(target.native) == b"first\n"


def test_two_writers_racing_to_publish_exactly_one_wins(s3_dir: str) -> None:
    first = backend().open_writer(s3_dir, KIND, INSTANCE, "step-1")
    second = backend().open_writer(s3_dir, KIND, INSTANCE, "step-1")
    # The second writer looked before the first published, then publishes after it: the create refuses it.
    second._existing_manifest = lambda: None  # type: ignore[method-assign]
    winner = first.write([record("a")])
    with pytest.raises(InvalidCheckpointState, match="from another write"):
        second.write([record("b")])
    assert backend().read_manifest(s3_dir, KIND, INSTANCE) == winner
    assert keys(s3_dir) == [f"gym/{KIND}/{INSTANCE}/manifest.json", f"gym/{KIND}/{INSTANCE}/{winner['records_file']}"]


def test_a_store_that_accepts_a_second_exclusive_create_is_refused_before_anything_is_written(
    lenient_store: str,
) -> None:
    with pytest.raises(StoreUnsafe, match="accepted a second exclusive create") as refused:
        write(lenient_store, [record("a")])
    assert refused.value.code == "invalid_checkpoint_state" and refused.value.data["cause"] == "no_exclusive_create"
    assert isinstance(refused.value, WriteFailed)  # the export is kept: a retry into a sound store works
    assert LenientMemoryFileSystem.store == {}  # the probe is gone, and nothing else was written


def manifest_key(url: str) -> str:
    return f"{ObjectPath(url).native}/gym/{KIND}/{INSTANCE}/manifest.json"


def records_key(url: str, manifest: dict) -> str:
    return f"{ObjectPath(url).native}/gym/{KIND}/{INSTANCE}/{manifest['records_file']}"


def test_a_tampered_records_object_is_refused_naming_the_digest(s3_dir: str) -> None:
    manifest = write(s3_dir, [record("a", blob="x" * 100), record("b", blob="y" * 100)])
    body = s3().cat_file(records_key(s3_dir, manifest))
    s3().pipe_file(records_key(s3_dir, manifest), body.replace(b"y" * 100, b"z" * 100))
    with pytest.raises(InvalidCheckpointState, match="digest does not match the manifest"):
        backend().read(s3_dir, KIND, INSTANCE)


def test_a_partial_upload_is_refused_naming_the_truncation(s3_dir: str) -> None:
    manifest = write(s3_dir, [record("a", blob="x" * 100), record("b", blob="y" * 100)])
    body = s3().cat_file(records_key(s3_dir, manifest))
    s3().pipe_file(records_key(s3_dir, manifest), body[: len(body) - 40])
    with pytest.raises(InvalidCheckpointState, match=r"truncated line \(after 1 records\)"):
        backend().read(s3_dir, KIND, INSTANCE)


def test_a_manifest_whose_records_are_missing_is_refused(s3_dir: str) -> None:
    manifest = write(s3_dir, [record("a")])
    s3().rm_file(records_key(s3_dir, manifest))
    with pytest.raises(InvalidCheckpointState, match=f"records file {manifest['records_file']} is missing"):
        backend().read(s3_dir, KIND, INSTANCE)


def test_a_prefix_without_a_manifest_is_refused(s3_dir: str) -> None:
    manifest = write(s3_dir, [record("a")])
    s3().rm_file(manifest_key(s3_dir))
    with pytest.raises(InvalidCheckpointState, match="no manifest.json: the checkpoint was never published"):
        backend().read(s3_dir, KIND, INSTANCE)
    assert manifest["record_count"] == 1


def test_a_large_records_file_is_uploaded_in_parts(s3_dir: str) -> None:
    part = UPLOAD_PART
    records = [record(f"r{i}", blob="q" * (1 << 20)) for i in range((2 * part >> 20) + 8)]
    manifest = write(s3_dir, records)
    info = s3().info(records_key(s3_dir, manifest))
    # An S3 multipart object's ETag ends in -<parts>; a plain PUT's never does.
    assert info["ETag"].strip('"').endswith("-3"), info["ETag"]
    assert backend().read(s3_dir, KIND, INSTANCE, scope=()).total == len(records)


def test_a_restore_streams_the_object_never_holding_it_whole(s3_dir: str) -> None:
    records = [record(f"r{i}", blob="w" * ((1 << 20) - 100)) for i in range(48)]
    write(s3_dir, records)
    tracemalloc.start()
    try:
        restored = backend().read(s3_dir, KIND, INSTANCE, scope={"r3"})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert restored.total == len(records) and len(restored.records) == 1
    # The body as it arrives, the reader's few batches in flight (as from a local disk) and the one
    # record kept: less than half of the 48 MiB object, and the same for any larger one.
    assert peak < 24 << 20, peak


def test_the_spool_is_removed_and_a_dead_writer_s_spool_too(s3_dir: str, tmp_path: Path) -> None:
    dead = tmp_path / f".ng-checkpoint-spool-{2**22 + 7}-{'0' * 32}.jsonl"  # a pid no process has
    dead.write_bytes(b"left by a SIGKILLed writer")
    mine = tmp_path / "notes.txt"
    mine.write_text("not a spool")
    backend(spool_dir=str(tmp_path)).open_writer(s3_dir, KIND, INSTANCE, "step-1").write([record("a")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_the_local_backend_refuses_a_url_naming_the_fsspec_backend(s3_dir: str) -> None:
    local = get_storage_backend(make_plugin_manager(load_entry_points=False), "local")
    with pytest.raises(WriteFailed, match="set checkpoint.storage.backend: fsspec"):
        local.open_writer(s3_dir, KIND, INSTANCE, "step-1").write([record("a")])
    with pytest.raises(WriteFailed, match="writes filesystem paths only"):
        local.read(s3_dir, KIND, INSTANCE)


def test_the_fsspec_backend_writes_a_plain_path_as_the_local_backend_does(tmp_path: Path) -> None:
    manifest = backend().open_writer(str(tmp_path), KIND, INSTANCE, "step-1").write([record("a")])
    assert (tmp_path / "gym" / KIND / INSTANCE / "manifest.json").stat().st_mode & 0o777 == 0o600
    assert backend().read(tmp_path, KIND, INSTANCE).manifest == manifest


def test_file_urls_go_through_fsspec_with_the_same_rules(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/ckpt"
    manifest = backend().open_writer(url, KIND, INSTANCE, "step-1").write([record("a"), record("b")])
    assert sorted(p.name for p in (tmp_path / "ckpt" / "gym" / KIND / INSTANCE).iterdir()) == [
        "manifest.json",
        manifest["records_file"],
    ]
    assert backend().read(url, KIND, INSTANCE, scope={"b"}).records == [record("b")]


@pytest.mark.parametrize(
    "url, message",
    [
        ("s3://AKIAEXAMPLE:hunter2secret@bucket/run", "must not carry credentials"),
        ("s3://bucket/run?versionId=3", "must not contain a query"),
        ("s3://bucket/../other", "must not contain . or .. components"),
        ("s3://", "names no bucket"),
    ],
)
def test_urls_that_cannot_name_a_checkpoint_directory_are_refused_without_repeating_them(
    url: str,
    message: str,
) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        ObjectPath(url)
    assert "hunter2secret" not in str(refused.value)


def test_messages_never_carry_the_secret_the_environment_holds(s3_server, s3_dir: str) -> None:  # noqa: ANN001
    failure = objstore.write_failed(RuntimeError(f"signature mismatch for {s3_server.secret}"), ObjectPath(s3_dir))
    assert s3_server.secret not in failure.detail and "***" in failure.detail


class UnreachableMemoryFileSystem(MemoryFileSystem):
    """A store that takes writes but cannot say whether a manifest is there (a HEAD that times out)."""

    protocol = ("unreachable",)
    store: dict = {}  # noqa: RUF012 - fsspec's own convention: the class holds the contents
    pseudo_dirs = [""]  # noqa: RUF012

    def exists(self, path, **kwargs):  # noqa: ANN001, ANN003, ANN201
        if str(path).endswith("manifest.json"):
            raise ConnectionError("read timeout on endpoint")
        return super().exists(path, **kwargs)


def test_a_store_that_does_not_answer_is_a_failed_write_and_the_export_is_kept() -> None:
    fsspec.register_implementation("unreachable", UnreachableMemoryFileSystem, clobber=True)
    objstore.reset_filesystems()
    try:
        with pytest.raises(WriteFailed, match="cannot look for a published manifest: .*ConnectionError"):
            write("unreachable://bucket/run", [record("a")])
    finally:
        UnreachableMemoryFileSystem.store.clear()
        objstore.reset_filesystems()
