"""``make demo``'s story with its checkpoints in an object store: the local S3 server (moto, 127.0.0.1).

Gym's own rollout collection, checkpointed into ``s3://...`` by every server (storage backend
``fsspec``), the collector and every server SIGKILLed, fresh processes, ``collect --resume``:
nothing lost, nothing repeated, the output identical to an uninterrupted run; then
``ng-checkpoint verify s3://...`` of the published checkpoint exits 0. The store is reached
only through the standard AWS variables; its secret appears in no output and no log.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from nemo_gym_checkpoint_plugin._storage.location import child_dirs, lexists
from nemo_gym_checkpoint_plugin._storage.objstore import ObjectPath

DEMO = [sys.executable, "-m", "nemo_gym_checkpoint_plugin.testing.demo"]
NG_CHECKPOINT = [sys.executable, "-m", "nemo_gym_checkpoint_plugin.cli"]


@pytest.mark.slow
def test_the_demo_story_checkpointed_into_s3_loses_nothing_and_verifies(s3_server, s3_dir, tmp_path: Path) -> None:  # noqa: ANN001
    result = subprocess.run(
        [*DEMO, "--dir", str(tmp_path), "--checkpoint-dir", s3_dir], capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = orjson.loads(result.stdout.strip().splitlines()[-1])
    assert summary["rollouts"] == 64 and summary["finished"] == 64 == summary["reward_1"]
    assert summary["lost"] == 0 and summary["repeated_steps"] == 0
    assert summary["identical_to_uninterrupted"] is True and summary["continued"] > 0
    assert summary["checkpoint_dir"] == f"{s3_dir}/ckpt"
    assert "SIGKILLed the collector and 5 server process groups" in result.stdout
    # Every checkpoint is in the store, none on the servers' disks.
    assert not (tmp_path / "ckpt").exists()
    root = ObjectPath(f"{s3_dir}/ckpt")
    published = [name for name in child_dirs(root) if lexists(root / name / "collector" / "manifest.json")]
    assert published
    for name in published:
        verified = subprocess.run(
            [*NG_CHECKPOINT, "verify", str(root / name)], capture_output=True, text=True, timeout=120
        )
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert "ok    environment/" in verified.stdout and verified.stderr == ""
    texts = [result.stdout, result.stderr, *(p.read_text(errors="replace") for p in (tmp_path / "logs").iterdir())]
    assert all(s3_server.secret not in text for text in texts)
