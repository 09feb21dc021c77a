"""Incremental checkpoints after a crash, on disk and in S3: pruned bases, tampered blocks.

A child (``crash_incremental_writer.py``) publishes step-1 (full), step-2 and step-3 (incremental:
each refers to the records of the ones before), and is SIGKILLed inside step-4's records. Then
``ng-checkpoint gc --keep 1 --yes`` (the retention rule ``collect --keep`` shares) prunes step-1 and
step-2; step-3 still restores whole, and ``verify`` passes, because nothing it refers to was removed.
A referenced records file tampered with afterwards is refused by name, ``invalid_checkpoint_state``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState
from nemo_gym_checkpoint_plugin._storage.location import location, names
from nemo_gym_checkpoint_plugin._storage.objstore import ObjectPath
from nemo_gym_checkpoint_plugin._storage.reader import read_checkpoint

HERE = Path(__file__).parent
NG_CHECKPOINT = [sys.executable, "-m", "nemo_gym_checkpoint_plugin.cli"]
COUNT, SIZE = 30, 4096


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(tmp_path / "ckpts") if request.param == "local" else request.getfixturevalue("s3_dir")


def write_and_kill(root: str) -> list[str]:
    seen: list[str] = []
    with subprocess.Popen(
        [sys.executable, str(HERE / "crash_incremental_writer.py"), root, str(COUNT), str(SIZE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            for line in child.stdout:
                seen.append(line.strip())
                if seen[-1] == "paused":
                    child.send_signal(signal.SIGKILL)
                    break
        finally:
            child.kill()
            child.wait(timeout=60)
    return seen


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NG_CHECKPOINT, *args], capture_output=True, text=True, timeout=120)


def expected() -> list[tuple[str, int]]:
    return sorted((f"r{i}", 1 if i in (2, 3) else 0) for i in range(COUNT))


def restored(root: str, name: str) -> list[tuple[str, int]]:
    records = read_checkpoint(f"{root}/{name}", "environment", "env").records
    assert all(len(r["blob"]) == SIZE for r in records)
    return sorted((r["episode_id"]["rollout_id"], r["v"]) for r in records)


def test_restore_after_keep_pruned_its_bases_and_refuse_a_tampered_block(root: str) -> None:
    seen = write_and_kill(root)
    assert seen == [
        "published step-1 schema_version 1",
        "published step-2 schema_version 2",
        "published step-3 schema_version 2",
        "paused",
    ]
    manifest = read_checkpoint(f"{root}/step-3", "environment", "env", scope=()).manifest
    assert manifest["depends_on"] == ["step-1", "step-2"]

    done = cli("gc", "--json", root, "--keep", "1", "--yes")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert sorted(report["removed"]) == ["step-1", "step-2"]
    actions = {row["name"]: row["action"] for row in report["checkpoints"]}
    # step-4 died inside its records: a write in progress on disk; in S3 only its local spool existed.
    in_progress = {} if "://" in root else {"step-4": "keep"}
    assert actions == {"step-1": "remove", "step-2": "remove", "step-3": "keep", **in_progress}
    # The bases lost their markers and manifests; the files step-3 refers to are all that is left.
    for segment in manifest["segments"]:
        directory = location(f"{root}/{segment['checkpoint']}") / "gym" / "environment" / "env"
        assert names(directory) == [segment["records_file"]]
    assert names(location(f"{root}/step-1") / "gym") == ["environment"]  # no participants.json

    assert restored(root, "step-3") == expected()
    verified = cli("verify", f"{root}/step-3")
    assert verified.returncode == 0, verified.stdout + verified.stderr

    # Tamper with a block step-3 refers to: refused by name, typed.
    target = location(f"{root}/step-1") / "gym" / "environment" / "env" / manifest["segments"][-1]["records_file"]
    if isinstance(target, ObjectPath):
        data = bytes(target.fs.cat_file(target.native))
        target.fs.pipe_file(target.native, data.replace(b'"v":0', b'"v":7', 1))
    else:
        target.write_bytes(target.read_bytes().replace(b'"v":0', b'"v":7', 1))
    with pytest.raises(InvalidCheckpointState) as refused:
        read_checkpoint(f"{root}/step-3", "environment", "env")
    assert refused.value.code == "invalid_checkpoint_state"
    assert target.name in refused.value.detail and "step-3 refers to" in refused.value.detail
    failed = cli("verify", f"{root}/step-3")
    assert failed.returncode != 0 and target.name in failed.stdout + failed.stderr
