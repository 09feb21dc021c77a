"""One collection per checkpoint directory: ``collect.lock`` held by a live process, taken over from a dead one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_gym_checkpoint_plugin.coordination._collect_lock import LOCK_NAME, CollectionLock, DirectoryLocked

HOLD = """
import sys
from nemo_gym_checkpoint_plugin.coordination._collect_lock import CollectionLock
lock = CollectionLock(sys.argv[1], "collect-0a0a0a0a@here", "0a0a0a0a", "/x/out.jsonl")
lock.acquire()
print("locked", flush=True)
sys.stdin.read()  # until the test closes it or kills this process
lock.release()
"""


def _holder(root: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "locked"
    return child


def test_a_live_holder_is_refused_at_once_named_then_a_dead_ones_lock_is_taken_over(tmp_path: Path) -> None:
    child = _holder(tmp_path)
    try:
        with pytest.raises(DirectoryLocked) as refused:
            CollectionLock(tmp_path, "collect-1b1b1b1b@here", "1b1b1b1b", "/x/out.jsonl").acquire()
        assert refused.value.holder is not None and refused.value.holder.pid == child.pid
        assert f"collector collect-0a0a0a0a@here (pid {child.pid} on host " in str(refused.value)
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate()  # reaps it and closes its pipes
    # Killed: the kernel dropped its flock, its file still names it. Taken over, and the dead holder returned.
    lock = CollectionLock(tmp_path, "collect-1b1b1b1b@here", "1b1b1b1b", "/x/out.jsonl")
    previous = lock.acquire()
    assert previous is not None and (previous.pid, previous.run) == (child.pid, "0a0a0a0a")
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / LOCK_NAME).read_text() == ""  # released: emptied, never deleted


def test_a_released_lock_is_simply_free(tmp_path: Path) -> None:
    child = _holder(tmp_path)
    child.communicate("")  # the holder releases and exits
    lock = CollectionLock(tmp_path, "collect-1b1b1b1b@here", "1b1b1b1b", "/x/out.jsonl")
    assert lock.acquire() is None
    lock.release()


def test_a_lock_naming_another_host_is_refused_even_when_its_flock_is_free(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).write_text(
        json.dumps({"owner": "collect-2c2c2c2c@far", "host": "far-away-host", "pid": 1, "run": "2c2c2c2c", "since": 0})
    )
    with pytest.raises(DirectoryLocked, match=f"once it is known to be gone, remove {tmp_path / LOCK_NAME}"):
        CollectionLock(tmp_path, "collect-1b1b1b1b@here", "1b1b1b1b", "/x/out.jsonl").acquire()


def test_a_reused_pid_does_not_keep_a_dead_collectors_lock(tmp_path: Path) -> None:
    import socket

    # This very process's pid, but another process start: the collector that wrote it is gone.
    (tmp_path / LOCK_NAME).write_text(
        json.dumps(
            {
                "owner": "collect-3d3d3d3d@here",
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "run": "3d3d3d3d",
                "pid_start": "1",
            }
        )
    )
    lock = CollectionLock(tmp_path, "collect-1b1b1b1b@here", "1b1b1b1b", "/x/out.jsonl")
    previous = lock.acquire()
    assert previous is not None and previous.run == "3d3d3d3d"
    lock.release()


def test_the_lock_file_is_never_opened_through_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_text("")
    (tmp_path / LOCK_NAME).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        CollectionLock(tmp_path, "collect-1b1b1b1b@here", "1b1b1b1b", "/x/out.jsonl").acquire()
