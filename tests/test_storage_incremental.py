"""Incremental checkpoints: unchanged versioned records are referred to by digest, on disk and in S3.

Every checkpoint here is written by one backend object (one server process's), into sibling
directories of one root, as ``collect`` and a controller writing ``<root>/step-N`` do.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest
from storage_support import record

from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState, WriteFailed
from nemo_gym_checkpoint_plugin._plugins import get_storage_backend, make_plugin_manager
from nemo_gym_checkpoint_plugin._settings import StorageSettings
from nemo_gym_checkpoint_plugin._storage import objstore
from nemo_gym_checkpoint_plugin._storage.index import write_participants_index
from nemo_gym_checkpoint_plugin._storage.location import location
from nemo_gym_checkpoint_plugin._storage.objstore import ObjectPath
from nemo_gym_checkpoint_plugin._storage.retention import plan_retention, remove_checkpoint
from nemo_gym_checkpoint_plugin.api import Versioned
from nemo_gym_checkpoint_plugin.cli._offline import verify_checkpoint

KIND, INSTANCE = "model", "policy_model"
COUNT = 20


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "ckpts")
    return request.getfixturevalue("s3_dir")


def make_backend(root: str) -> Any:
    name = "fsspec" if "://" in root else "local"
    return get_storage_backend(make_plugin_manager(load_entry_points=False), StorageSettings(backend=name))


class Episodes:
    """A participant holding COUNT episodes with a version counter each; ``built`` lists the records it built."""

    def __init__(self) -> None:
        self.versions = dict.fromkeys(range(COUNT), 0)
        self.built: list[int] = []

    def change(self, *indexes: int) -> None:
        for index in indexes:
            self.versions[index] += 1

    def records(self) -> list[Any]:
        items: list[Any] = []
        for index, version in self.versions.items():

            def build(index: int = index, version: int = version) -> dict:
                self.built.append(index)
                return record(f"r{index}", blob="b" * 500, v=version, nan=float("nan"), big=2**70 + index)

            items.append(Versioned({"rollout_id": f"r{index}", "attempt": 0}, version, build))
        items.append(record("plain", v=-1))  # not versioned: written every time
        return items

    def commit(self, backend: Any, root: str, name: str) -> dict:
        self.built = []
        checkpoint_dir = f"{root}/{name}"
        manifest = backend.open_writer(checkpoint_dir, KIND, INSTANCE, name).write(self.records())
        write_participants_index(checkpoint_dir, name, [{"kind": KIND, "instance": INSTANCE, **_digest(manifest)}])
        return manifest

    def expect(self) -> list[tuple[str, int]]:
        return sorted([(f"r{i}", v) for i, v in self.versions.items()] + [("plain", -1)])


def _digest(manifest: dict) -> dict:
    return {"records_sha256": manifest["records_sha256"]}


def restored(backend: Any, root: str, name: str) -> list[tuple[str, int]]:
    records = backend.read(f"{root}/{name}", KIND, INSTANCE).records
    for item in records:
        if item["episode_id"]["rollout_id"] != "plain":
            assert item["big"] == 2**70 + int(item["episode_id"]["rollout_id"][1:]) and item["nan"] != item["nan"]
    return sorted((r["episode_id"]["rollout_id"], r["v"]) for r in records)


def files(root: str, name: str) -> list[str]:
    where = location(f"{root}/{name}")
    if isinstance(where, ObjectPath):
        prefix = where.native
        return sorted(n[len(prefix) + 1 :] for n in objstore.filesystem(where.protocol).find(prefix))
    return sorted(str(p.relative_to(where)) for p in where.rglob("*") if p.is_file())


def test_unchanged_records_are_referred_to_never_built_and_restore_whole(root: str) -> None:
    backend, episodes = make_backend(root), Episodes()
    first = episodes.commit(backend, root, "step-1")
    assert first["schema_version"] == 1 and "segments" not in first and len(episodes.built) == COUNT
    episodes.change(3, 7)
    second = episodes.commit(backend, root, "step-2")
    # Only the changed records were built and written (plus the unversioned one).
    assert sorted(episodes.built) == [3, 7] and second["record_count"] == 3
    assert second["schema_version"] == 2 and second["depends_on"] == ["step-1"]
    [segment] = second["segments"]
    assert segment["checkpoint"] == "step-1" and segment["records_file"] == first["records_file"]
    assert segment["lines"] == [[0, 3], [4, 7], [8, COUNT]]
    assert restored(backend, root, "step-2") == episodes.expect()
    episodes.change(3, 12)
    third = episodes.commit(backend, root, "step-3")
    assert sorted(episodes.built) == [3, 12] and third["depends_on"] == ["step-1", "step-2"]
    assert restored(backend, root, "step-3") == episodes.expect()
    # verify follows the references too: every participant of every checkpoint verifies.
    for name in ("step-1", "step-2", "step-3"):
        assert all(check.ok for check in verify_checkpoint(location(f"{root}/{name}")))


def test_a_full_checkpoint_is_byte_for_byte_schema_version_1(root: str) -> None:
    episodes = Episodes()
    episodes.commit(make_backend(root), root, "step-1")
    plain = [item.record() if isinstance(item, Versioned) else item for item in episodes.records()]
    again = make_backend(root).open_writer(f"{root}/other", KIND, INSTANCE, "step-1").write(plain)
    for name in ("step-1", "other"):
        assert any(f.endswith(again["records_file"]) for f in files(root, name))
    raw = _read(f"{root}/step-1/gym/{KIND}/{INSTANCE}/manifest.json")
    assert raw == _read(f"{root}/other/gym/{KIND}/{INSTANCE}/manifest.json")
    assert list(orjson.loads(raw)) == [
        "schema_version",
        "kind",
        "instance",
        "checkpoint_id",
        "records_file",
        "records_sha256",
        "record_count",
    ]


def _read(url_or_path: str) -> bytes:
    where = location(url_or_path)
    if isinstance(where, ObjectPath):
        return bytes(where.fs.cat_file(where.native))
    return where.read_bytes()


def test_retention_prunes_earlier_checkpoints_to_what_the_kept_one_refers_to(root: str) -> None:
    backend, episodes = make_backend(root), Episodes()
    first = episodes.commit(backend, root, "step-1")
    episodes.change(1)
    episodes.commit(backend, root, "step-2")
    episodes.change(2)
    third = episodes.commit(backend, root, "step-3")
    plan = plan_retention(root, 1)
    assert [c.name for c in plan.kept] == ["step-3"] and {c.name for c in plan.remove} == {"step-1", "step-2"}
    for checkpoint in plan.remove:
        assert remove_checkpoint(checkpoint)
    # No marker, no manifest: only the records files step-3 refers to are left of them.
    assert files(root, "step-1") == [f"gym/{KIND}/{INSTANCE}/{first['records_file']}"]
    referred = {s["checkpoint"]: s["records_file"] for s in third["segments"]}
    assert files(root, "step-2") == [f"gym/{KIND}/{INSTANCE}/{referred['step-2']}"]
    assert restored(backend, root, "step-3") == episodes.expect()
    # Once a full checkpoint supersedes them (every record changed), the rest goes too.
    episodes.change(*range(COUNT))
    fourth = episodes.commit(backend, root, "step-4")
    assert fourth["schema_version"] == 1
    for checkpoint in plan_retention(root, 1).remove:
        remove_checkpoint(checkpoint)
    assert [files(root, name) for name in ("step-1", "step-2", "step-3")] == [[], [], []]
    assert restored(backend, root, "step-4") == episodes.expect()


def test_a_tampered_referenced_file_is_refused_naming_it(root: str) -> None:
    backend, episodes = make_backend(root), Episodes()
    first = episodes.commit(backend, root, "step-1")
    episodes.change(0)
    episodes.commit(backend, root, "step-2")
    target = f"{root}/step-1/gym/{KIND}/{INSTANCE}/{first['records_file']}"
    data = _read(target).replace(b'"v":0', b'"v":9', 1)
    where = location(target)
    if isinstance(where, ObjectPath):
        where.fs.pipe_file(where.native, data)
    else:
        where.write_bytes(data)
    with pytest.raises(InvalidCheckpointState) as refused:
        backend.read(f"{root}/step-2", KIND, INSTANCE)
    assert refused.value.code == "invalid_checkpoint_state"
    assert first["records_file"] in refused.value.detail and "step-2 refers to" in refused.value.detail
    assert "digest does not match" in refused.value.detail
    [check] = verify_checkpoint(location(f"{root}/step-2"))
    assert not check.ok and first["records_file"] in (check.problem or "")


def test_a_checkpoint_outside_the_previous_one_s_parent_is_full(root: str) -> None:
    backend, episodes = make_backend(root), Episodes()
    episodes.commit(backend, root, "step-1")
    episodes.change(0)
    elsewhere = episodes.commit(backend, f"{root}/nested", "step-2")
    assert elsewhere["schema_version"] == 1 and len(episodes.built) == COUNT


def test_mostly_superseded_files_are_written_again_not_referred_to(root: str) -> None:
    backend, episodes = make_backend(root), Episodes()
    episodes.commit(backend, root, "step-1")
    episodes.change(*range(COUNT // 2 + 2))  # more than half of step-1's lines superseded
    second = episodes.commit(backend, root, "step-2")
    assert second["depends_on"] == ["step-1"]
    # step-2 uses less than half of step-1's lines: the next checkpoint writes them again.
    third = episodes.commit(backend, root, "step-3")
    assert sorted(episodes.built) == list(range(COUNT // 2 + 2, COUNT))
    assert third["depends_on"] == ["step-2"] and restored(backend, root, "step-3") == episodes.expect()


def test_a_referenced_file_removed_during_the_write_fails_it_and_the_retry_is_full(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpts")
    backend, episodes = make_backend(root), Episodes()
    first = episodes.commit(backend, root, "step-1")
    episodes.change(0)
    segment = Path(root) / "step-1" / "gym" / KIND / INSTANCE / first["records_file"]

    def records() -> Any:
        yield from episodes.records()
        os.unlink(segment)  # a removal between the plan and the publish

    writer = backend.open_writer(f"{root}/step-2", KIND, INSTANCE, "step-2")
    with pytest.raises(WriteFailed, match="refers to were removed"):
        writer.write(records())
    assert not (Path(root) / "step-2" / "gym" / KIND / INSTANCE / "manifest.json").exists()
    retried = backend.open_writer(f"{root}/step-2", KIND, INSTANCE, "step-2").write(episodes.records())
    assert retried["schema_version"] == 1 and restored(backend, root, "step-2") == episodes.expect()


def test_a_versioned_record_of_another_episode_or_twice_is_refused(tmp_path: Path) -> None:
    backend = make_backend(str(tmp_path))
    wrong = Versioned({"rollout_id": "a", "attempt": 0}, 1, record("b"))
    with pytest.raises(InvalidCheckpointState, match="versioned episode a names episode b"):
        backend.open_writer(str(tmp_path / "c1"), KIND, INSTANCE, "c1").write([wrong])
    twice = [Versioned({"rollout_id": "a", "attempt": 0}, 1, record("a"))] * 2
    with pytest.raises(InvalidCheckpointState, match="exported twice"):
        backend.open_writer(str(tmp_path / "c2"), KIND, INSTANCE, "c2").write(twice)


@pytest.mark.parametrize(
    "change",
    [
        {"segments": []},
        {"depends_on": ["elsewhere"]},
        {"segments": [{"checkpoint": "../x"}]},
        {"lines": [[3, 1]]},
        {"lines": [[0, 10_000]]},
        {"lines": [[0, 2], [1, 3]]},
        {"record_count": 0},
    ],
)
def test_a_malformed_incremental_manifest_is_refused_by_name(tmp_path: Path, change: dict) -> None:
    root = str(tmp_path / "ckpts")
    backend, episodes = make_backend(root), Episodes()
    episodes.commit(backend, root, "step-1")
    episodes.change(0)
    episodes.commit(backend, root, "step-2")
    path = Path(root) / "step-2" / "gym" / KIND / INSTANCE / "manifest.json"
    manifest = orjson.loads(path.read_bytes())
    if "lines" in change or "record_count" in change:
        manifest["segments"][0].update(change)
    else:
        manifest.update(change)
    path.write_bytes(orjson.dumps(manifest))
    with pytest.raises(InvalidCheckpointState, match="segment|depends_on"):
        backend.read(f"{root}/step-2", KIND, INSTANCE)


def test_a_manifest_extra_may_not_take_the_incremental_fields(tmp_path: Path) -> None:
    with pytest.raises(InvalidCheckpointState, match="replace a protocol field"):
        make_backend(str(tmp_path)).open_writer(str(tmp_path / "c"), KIND, INSTANCE, "c").write([], {"segments": 1})


def test_a_built_record_may_not_name_another_owner(tmp_path: Path) -> None:
    backend = make_backend(str(tmp_path))
    own = Versioned({"rollout_id": "a", "attempt": 0}, 1, record("a", plugin="x"))
    with pytest.raises(InvalidCheckpointState, match="sets 'plugin'"):
        backend.open_writer(str(tmp_path / "c1"), KIND, INSTANCE, "c1").write([own])
    other = Versioned({"rollout_id": "a", "attempt": 0}, 1, record("a", plugin="x"), "y")
    with pytest.raises(InvalidCheckpointState, match="naming 'x'"):
        backend.open_writer(str(tmp_path / "c2"), KIND, INSTANCE, "c2").write([other])
