"""Child process for the storage crash test: writes a checkpoint, announcing (and optionally pausing at) stages.

Usage: python crash_writer.py ROOT COUNT RECORD_BYTES PAUSE_AT
PAUSE_AT is one of: none, before, record:<k>, renamed, link. At the pause it prints
"paused" and blocks reading stdin, so the parent can SIGKILL it exactly there.
"""

from __future__ import annotations

import os
import sys

from nemo_gym_checkpoint_plugin._storage import CheckpointWriter

root, count, size, pause_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]


def stage(name: str) -> None:
    print(name, flush=True)
    if name == pause_at:
        print("paused", flush=True)
        sys.stdin.readline()


real_replace, real_link = os.replace, os.link


def replace(src, dst):  # noqa: ANN001
    real_replace(src, dst)
    stage("renamed")


def link(src, dst):  # noqa: ANN001
    stage("link")
    real_link(src, dst)


os.replace, os.link = replace, link


def records():
    for index in range(count):
        stage(f"record:{index}")
        yield {"episode_id": {"rollout_id": f"r{index}", "attempt": 0}, "blob": "x" * size}


stage("before")
CheckpointWriter(root, "environment", "env", "ckpt-1").write(records())
stage("published")
