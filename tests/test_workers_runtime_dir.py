"""The runtime directory of a multi-worker server (``_workers/runtime_dir.py``): one rule per test."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_gym_checkpoint_plugin._workers.runtime_dir import (
    PREFIX,
    SOCKET_PATH_MAX,
    RuntimeDir,
    create_runtime_dir,
    pid_alive,
    socket_accepts,
    sweep_dead,
)


def _dead_pid() -> int:
    # Above the kernel's pid_max no process can exist: a pid that is certainly gone, without racing reuse.
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    except OSError:
        return 2**22 + 1


@pytest.fixture
def root() -> Iterator[Path]:
    # A private, short root under /tmp (socket paths must stay short), never the real /tmp sweep.
    path = Path(tempfile.mkdtemp(prefix="rdt", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _left_behind(root: Path, pid: int, suffix: str = "abc123") -> Path:
    path = root / f"{PREFIX}{pid}-{suffix}"
    path.mkdir(mode=0o700)
    return path


def _stale_socket(directory: Path, name: str = "c.sock") -> Path:
    """A socket file whose listener is gone (bound, then closed without unlinking)."""
    path = directory / name
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.close()
    return path


def _listening(directory: Path, name: str = "c.sock") -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(directory / name))
    listener.listen()
    return listener


def test_created_directory_is_private_named_by_pid_and_short(root: Path) -> None:
    runtime = create_runtime_dir(root, remove_at_exit=False)
    try:
        info = runtime.path.lstat()
        assert stat.S_ISDIR(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o700
        assert info.st_uid == os.getuid()
        assert runtime.path.parent == root
        assert runtime.path.name.startswith(f"{PREFIX}{os.getpid()}-")
        sock = runtime.socket_path("c.sock")
        assert Path(sock).parent == runtime.path
        assert len(os.fsencode(sock)) <= SOCKET_PATH_MAX
    finally:
        runtime.remove()
    assert not runtime.path.exists()


def test_socket_path_refuses_what_a_unix_socket_cannot_hold(root: Path) -> None:
    runtime = RuntimeDir(path=root / ("d" * 100), owner_pid=os.getpid())
    with pytest.raises(ValueError, match="longer than 107 bytes"):
        runtime.socket_path("c.sock")
    for bad in ("", "a/b", "..", "."):
        with pytest.raises(ValueError, match="one path component"):
            RuntimeDir(path=root, owner_pid=os.getpid()).socket_path(bad)


def test_remove_is_idempotent_and_only_from_the_creating_process(root: Path) -> None:
    path = _left_behind(root, os.getpid())
    RuntimeDir(path=path, owner_pid=os.getpid() + 1).remove()  # as a forked child would
    assert path.is_dir()
    mine = RuntimeDir(path=path, owner_pid=os.getpid())
    mine.remove()
    mine.remove()
    assert not path.exists()


@pytest.mark.slow
def test_directory_is_removed_when_the_process_exits(root: Path) -> None:
    code = (
        "import sys; from nemo_gym_checkpoint_plugin._workers.runtime_dir import create_runtime_dir; "
        "print(create_runtime_dir(sys.argv[1]).path, flush=True)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    made = Path(done.stdout.strip())
    assert made.parent == root
    assert not made.exists()


def test_pid_alive_tells_a_live_process_from_a_gone_one() -> None:
    assert pid_alive(os.getpid())
    assert pid_alive(1)  # init: another user's process counts as alive (EPERM is not "gone")
    assert not pid_alive(_dead_pid())
    assert not pid_alive(0)
    assert not pid_alive(-5)


def test_socket_accepts_only_a_listening_socket(root: Path) -> None:
    assert not socket_accepts(root / "missing.sock")
    assert not socket_accepts(_stale_socket(root, "stale.sock"))
    with _listening(root, "live.sock"):
        assert socket_accepts(root / "live.sock")


def test_sweep_removes_a_dead_server_directory_whose_sockets_refuse(root: Path) -> None:
    dead = _left_behind(root, _dead_pid())
    _stale_socket(dead)
    (dead / "note").write_text("left by a SIGKILL")
    empty = _left_behind(root, _dead_pid(), "xyz789")
    assert sorted(sweep_dead(root)) == sorted([dead, empty])
    assert not dead.exists()
    assert not empty.exists()


def test_sweep_keeps_a_dead_pid_whose_socket_accepts(root: Path) -> None:
    # The pid is gone here, but a server in another pid namespace sharing /tmp still listens.
    elsewhere = _left_behind(root, _dead_pid())
    _stale_socket(elsewhere, "w1.sock")
    with _listening(elsewhere, "c.sock"):
        assert sweep_dead(root) == []
        assert elsewhere.is_dir()


def test_sweep_keeps_a_live_pid_without_any_socket(root: Path) -> None:
    alive = _left_behind(root, os.getpid(), "live01")
    assert sweep_dead(root) == []
    assert alive.is_dir()


def test_sweep_never_removes_by_age(root: Path) -> None:
    old = _left_behind(root, os.getpid(), "old001")
    _stale_socket(old)
    os.utime(old, (0, 0))  # 1970
    assert sweep_dead(root) == []
    assert old.is_dir()


def test_sweep_leaves_what_is_not_a_runtime_directory(root: Path) -> None:
    other_name = root / f"other-{_dead_pid()}-abc"
    other_name.mkdir()
    plain_file = root / f"{PREFIX}{_dead_pid()}-file01"
    plain_file.write_text("not a directory")
    target = _left_behind(root, _dead_pid(), "target")
    link = root / f"{PREFIX}{_dead_pid()}-link01"
    link.symlink_to(target)
    removed = sweep_dead(root)
    assert removed == [target]
    assert other_name.is_dir()
    assert plain_file.is_file()
    assert link.is_symlink()


def test_creating_one_sweeps_dead_directories_first(root: Path) -> None:
    dead = _left_behind(root, _dead_pid())
    _stale_socket(dead)
    alive = _left_behind(root, os.getpid(), "kept01")
    runtime = create_runtime_dir(root, remove_at_exit=False)
    try:
        assert runtime.swept == [dead]
        assert not dead.exists()
        assert alive.is_dir()
        assert runtime.path.is_dir()
    finally:
        runtime.remove()
