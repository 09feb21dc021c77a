"""SIGKILL a child writing a large checkpoint at random points: never a half-published checkpoint."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState
from nemo_gym_checkpoint_plugin._storage import CheckpointWriter, read_checkpoint

HERE = Path(__file__).parent
COUNT = 120
SIZE = 64 * 1024


def run_and_kill(root: Path, pause_at: str, kill_after: str) -> list[str]:
    """Start the writer; SIGKILL it as soon as it prints ``kill_after`` (or pauses); return what it printed."""
    seen = []
    with subprocess.Popen(
        [sys.executable, str(HERE / "crash_writer.py"), str(root), str(COUNT), str(SIZE), pause_at],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            for line in child.stdout:
                seen.append(line.strip())
                if seen[-1] in (kill_after, "paused"):
                    child.send_signal(signal.SIGKILL)
                    break
        finally:
            child.kill()
            child.wait(timeout=30)
    return seen


def check_outcome(root: Path) -> str:
    """Either a complete, verifiable checkpoint, or one without a manifest that restore refuses."""
    directory = root / "gym" / "environment" / "env"
    if (directory / "manifest.json").exists():
        restored = read_checkpoint(root, "environment", "env")
        assert [r["episode_id"]["rollout_id"] for r in restored.records] == [f"r{i}" for i in range(COUNT)]
        assert all(len(r["blob"]) == SIZE for r in restored.records)
        return "complete"
    with pytest.raises(InvalidCheckpointState):
        read_checkpoint(root, "environment", "env")
    return "unpublished"


KILL_POINTS = (
    [("before", "paused"), ("renamed", "paused"), ("link", "paused"), ("none", "published")]
    # Paused exactly inside the records, and killed while still running at random record counts.
    + [(f"record:{k}", "paused") for k in random.Random(7).sample(range(COUNT), 4)]
    + [("none", f"record:{k}") for k in random.Random(11).sample(range(COUNT), 6)]
)


@pytest.mark.slow
@pytest.mark.parametrize(("pause_at", "kill_after"), KILL_POINTS)
def test_sigkill_leaves_complete_or_unpublished(tmp_path: Path, pause_at: str, kill_after: str) -> None:
    seen = run_and_kill(tmp_path, pause_at, kill_after)
    outcome = check_outcome(tmp_path)
    if "published" in seen:
        assert outcome == "complete"
    if pause_at in ("before", "renamed", "link") or pause_at.startswith("record:"):
        assert outcome == "unpublished", f"killed at {pause_at} but a manifest exists"
    # The directory stays usable: committing the same checkpoint again completes (or returns the one there).
    records = [{"episode_id": {"rollout_id": f"r{i}", "attempt": 0}, "blob": "x" * SIZE} for i in range(COUNT)]
    CheckpointWriter(tmp_path, "environment", "env", "ckpt-1").write(records)
    assert check_outcome(tmp_path) == "complete"
    assert os.path.exists(tmp_path / "gym" / "environment" / "env" / "manifest.json")
