"""The participants index: written by the controller after every commit, checked by verify and restore."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import orjson
import pytest
from coord_support import FOUR, TOKEN, start_participants, stop_participants
from storage_support import record, write

from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState
from nemo_gym_checkpoint_plugin._storage.index import (
    check_participants_index,
    index_path,
    read_participants_index,
    write_participants_index,
)
from nemo_gym_checkpoint_plugin.coordination import CoordinationError, commit, discover, prepare, restore, resume


def entry(manifest: dict) -> dict:
    return {k: manifest[k] for k in ("kind", "instance", "records_sha256")}


def two_participants(root: Path) -> list[dict]:
    return [
        write(root, [record("a")], kind="model", instance="m", checkpoint_id="c1"),
        write(root, [record("b")], kind="agent", instance="g", checkpoint_id="c1"),
    ]


def test_index_is_created_once_and_read_back(tmp_path: Path) -> None:
    manifests = two_participants(tmp_path)
    index = write_participants_index(tmp_path, "c1", [entry(m) for m in manifests])
    assert index == {
        "schema_version": 1,
        "checkpoint_id": "c1",
        "participants": sorted((entry(m) for m in manifests), key=lambda e: (e["kind"], e["instance"])),
    }
    assert orjson.loads(index_path(tmp_path).read_bytes()) == index == read_participants_index(tmp_path)
    # The same index again (a retried commit): fine. Another one: refused, never replaced.
    assert write_participants_index(tmp_path, "c1", [entry(m) for m in reversed(manifests)]) == index
    with pytest.raises(InvalidCheckpointState, match="another set of participants"):
        write_participants_index(tmp_path, "c1", [entry(manifests[0])])
    assert read_participants_index(tmp_path) == index
    assert sorted(p.name for p in (tmp_path / "gym").iterdir()) == ["agent", "model", "participants.json"]


def test_a_participant_the_index_lists_must_be_there(tmp_path: Path) -> None:
    manifests = two_participants(tmp_path)
    write_participants_index(tmp_path, "c1", [entry(m) for m in manifests])
    assert check_participants_index(tmp_path)["checkpoint_id"] == "c1"
    shutil.rmtree(tmp_path / "gym" / "agent" / "g")
    with pytest.raises(InvalidCheckpointState, match="agent/g is listed in participants.json but .* is missing"):
        check_participants_index(tmp_path)


def test_a_participant_replaced_by_another_write_is_named(tmp_path: Path) -> None:
    manifests = two_participants(tmp_path)
    write_participants_index(tmp_path, "c1", [entry(m) for m in manifests])
    shutil.rmtree(tmp_path / "gym" / "model" / "m")
    write(tmp_path, [record("other")], kind="model", instance="m", checkpoint_id="c1")
    with pytest.raises(InvalidCheckpointState, match="model/m: its manifest's records_sha256 differs"):
        check_participants_index(tmp_path)


@pytest.mark.parametrize(
    "body",
    [
        b"[]",
        b"{",
        b'{"schema_version": 2, "checkpoint_id": "c", "participants": []}',
        b'{"schema_version": 1, "checkpoint_id": "c", "participants": [{"kind": "../x", '
        b'"instance": "i", "records_sha256": "00"}]}',
    ],
)
def test_a_malformed_index_is_refused(tmp_path: Path, body: bytes) -> None:
    index_path(tmp_path).parent.mkdir(parents=True)
    index_path(tmp_path).write_bytes(body)
    with pytest.raises(InvalidCheckpointState):
        read_participants_index(tmp_path)


def test_a_fifo_index_is_refused_without_blocking(tmp_path: Path) -> None:
    index_path(tmp_path).parent.mkdir(parents=True)
    os.mkfifo(index_path(tmp_path))
    with pytest.raises(InvalidCheckpointState, match="FIFO"):
        read_participants_index(tmp_path)


async def test_the_controller_writes_the_index_and_restore_checks_it_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    servers = start_participants(tmp_path, [dict(spec, holds=["r1"]) for spec in FOUR])
    ckpt = tmp_path / "ckpt"
    try:
        async with await discover([s.url for s in servers], TOKEN) as coordinator:
            assert (await prepare(coordinator, "step-1", timeout=10)).ready
            committed = await commit(coordinator, "step-1", str(ckpt), ["r1"], timeout=10)
            await resume(coordinator, "step-1", timeout=10)
            index = read_participants_index(ckpt)
            assert index["checkpoint_id"] == "step-1"
            assert sorted((e["kind"], e["instance"], e["records_sha256"]) for e in index["participants"]) == sorted(
                (m["kind"], m["instance"], m["records_sha256"]) for m in committed.manifests.values()
            )
            # The agent's whole directory is lost: restore fails naming it, before asking anyone.
            shutil.rmtree(ckpt / "gym" / "agent")
            with pytest.raises(CoordinationError, match="agent/agent is listed") as caught:
                await restore(coordinator, "restore-1", str(ckpt), ["r1"], timeout=10)
            assert caught.value.codes == {"(checkpoint)": "invalid_checkpoint_state"}
            assert all("restore" not in server.ops() for server in servers)
            # Without an index, restore goes ahead (and warns).
            index_path(ckpt).unlink()
            shutil.rmtree(ckpt / "gym")
            assert (await prepare(coordinator, "step-2", timeout=10)).ready
            await commit(coordinator, "step-2", str(ckpt), ["r1"], timeout=10)
            await resume(coordinator, "step-2", timeout=10)
            index_path(ckpt).unlink()
            with caplog.at_level(logging.WARNING):
                await restore(coordinator, "restore-2", str(ckpt), ["r1"], timeout=10)
            assert "no participants index" in caplog.text
            await resume(coordinator, "restore-2", timeout=10)
    finally:
        stop_participants(servers)
