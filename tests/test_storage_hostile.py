"""Hostile checkpoint directories: special files, repeated capture keys, endless lines, dead writers' leftovers."""

from __future__ import annotations

import os
import threading
import tracemalloc
from pathlib import Path

import orjson
import pytest
from storage_support import fd_count, record, write

from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState, WriteFailed
from nemo_gym_checkpoint_plugin._storage import CheckpointWriter, LocalStorage, read_checkpoint
from nemo_gym_checkpoint_plugin._storage.pipeline import hashed_lines

KIND, INSTANCE = "model", "policy_model"


def pdir(root: Path, kind: str = KIND, instance: str = INSTANCE) -> Path:
    return root / "gym" / kind / instance


def bounded(call, timeout: float = 20.0):  # noqa: ANN001, ANN201
    """Run ``call`` in a thread; fail (instead of hanging the suite) if it does not return in time."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the call blocked"
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome.get("value")


def records_path(root: Path) -> Path:
    directory = pdir(root)
    return directory / orjson.loads((directory / "manifest.json").read_bytes())["records_file"]


def make_fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def make_dir(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.mkdir()


# -- special files -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "special", "message"),
    [
        ("manifest", make_fifo, "not a regular file .a FIFO"),
        ("records", make_fifo, "not a regular file .a FIFO"),
        ("records", make_dir, "not a regular file .a directory"),
        ("manifest", make_dir, "not a regular file .a directory"),
    ],
)
def test_special_files_are_refused_without_blocking_or_leaking(tmp_path: Path, where, special, message) -> None:
    write(tmp_path, [record("a")])
    special(pdir(tmp_path) / "manifest.json" if where == "manifest" else records_path(tmp_path))
    before = fd_count()
    with pytest.raises(InvalidCheckpointState, match=message):
        bounded(lambda: read_checkpoint(tmp_path, KIND, INSTANCE))
    assert fd_count() == before


def test_writer_refuses_a_fifo_manifest_without_blocking(tmp_path: Path) -> None:
    pdir(tmp_path).mkdir(parents=True)
    os.mkfifo(pdir(tmp_path) / "manifest.json")
    before = fd_count()
    with pytest.raises(InvalidCheckpointState, match="FIFO") as refused:
        bounded(lambda: write(tmp_path, [record("a")]))
    assert not isinstance(refused.value, WriteFailed)
    assert fd_count() == before


# -- repeated capture keys ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["environment", "model", "agent", "resources"])
def test_a_repeated_capture_key_is_refused_naming_it(tmp_path: Path, kind: str) -> None:
    CheckpointWriter(tmp_path, kind, "p", "c1").write(
        [record("a", v=1), record("r", 1), record("b"), record("r", 1, v=2)]
    )
    for scope in (None, {"a"}, set()):  # wherever it lies, in scope or not
        with pytest.raises(InvalidCheckpointState, match="repeats episode r-a1") as refused:
            read_checkpoint(tmp_path, kind, "p", scope=scope)
        assert refused.value.data["episode"] == "r-a1"


# -- record size -------------------------------------------------------------------------------------------------


def test_the_writer_refuses_a_record_beyond_the_bound_naming_it(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, KIND, INSTANCE, "c1", max_record_bytes=1000)
    with pytest.raises(InvalidCheckpointState, match="episode big is .* more than max_record_bytes") as refused:
        writer.write([record("ok", blob="x" * 100), record("big", blob="x" * 2000)])
    assert not isinstance(refused.value, WriteFailed)  # an export error, not the filesystem's
    assert list(pdir(tmp_path).iterdir()) == []


class CountingReader:
    """A file object that counts the bytes handed out, to show how much of a line was read."""

    def __init__(self, handle) -> None:  # noqa: ANN001
        self.handle, self.read_bytes = handle, 0

    def read(self, size: int = -1) -> bytes:
        data = self.handle.read(size)
        self.read_bytes += len(data)
        return data

    def readline(self, limit: int = -1) -> bytes:
        line = self.handle.readline(limit)
        self.read_bytes += len(line)
        return line

    def __iter__(self):  # noqa: ANN204 - the unbounded way, counted the same
        for line in self.handle:
            self.read_bytes += len(line)
            yield line


def test_an_endless_line_is_refused_after_reading_at_most_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "endless"
    with open(path, "wb") as out:
        out.write(b'{"episode_id":{"rollout_id":"a","attempt":0}}\n')
        out.write(b"7" * (16 << 20))  # 16 MiB and no newline
    with open(path, "rb") as handle:
        counting = CountingReader(handle)
        items = list(hashed_lines(counting, 1 << 20))
    end = items[-1]
    assert end.too_long and end.count == 1
    assert counting.read_bytes <= 48 + (1 << 20) + 1


def test_restore_of_an_endless_line_does_not_hold_it(tmp_path: Path) -> None:
    write(tmp_path, [record("a")])
    with open(records_path(tmp_path), "ab") as out:
        out.write(b"7" * (48 << 20))
    backend = LocalStorage(max_record_bytes=1 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidCheckpointState, match=r"record 1 is longer than max_record_bytes \(1048576"):
            backend.read(tmp_path, KIND, INSTANCE)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 12 << 20, peak  # a few buffers of the bound, never the 48 MiB line


# -- leftovers of dead writers -----------------------------------------------------------------------------------


def leave_leftovers(directory: Path) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    names = [".records.0123abcd.tmp", ".manifest.89ef.tmp", f"records-{'0' * 64}.jsonl"]
    for name in names:
        (directory / name).write_bytes(b"x" * 1000)
    return names


def test_a_write_removes_what_a_dead_writer_left(tmp_path: Path) -> None:
    leave_leftovers(pdir(tmp_path))
    (pdir(tmp_path) / "notes.txt").write_text("not ours")  # never touched: not a name a writer uses
    manifest = write(tmp_path, [record("a")])
    assert sorted(p.name for p in pdir(tmp_path).iterdir()) == ["manifest.json", "notes.txt", manifest["records_file"]]


def test_a_live_writer_s_files_are_left_alone(tmp_path: Path) -> None:
    """While another writer holds the directory (its shared lock), nothing there is a dead writer's."""
    import fcntl

    names = leave_leftovers(pdir(tmp_path))
    fd = os.open(pdir(tmp_path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        manifest = write(tmp_path, [record("a")])
    finally:
        os.close(fd)
    assert sorted(p.name for p in pdir(tmp_path).iterdir()) == sorted(
        [*names, "manifest.json", manifest["records_file"]]
    )


def test_with_a_manifest_published_only_temporary_files_go(tmp_path: Path) -> None:
    first = write(tmp_path, [record("a")])
    leave_leftovers(pdir(tmp_path))
    assert write(tmp_path, [record("a")]) == first
    assert sorted(p.name for p in pdir(tmp_path).iterdir()) == sorted(
        ["manifest.json", first["records_file"], f"records-{'0' * 64}.jsonl"]
    )


# -- stop() racing the publication -------------------------------------------------------------------------------


class SignallingLock:
    """The writer's lock, announcing when a thread other than the writer's starts waiting for it."""

    def __init__(self, writer_thread: threading.Thread) -> None:
        self._lock = threading.Lock()
        self.writer_thread = writer_thread
        self.waiting = threading.Event()

    def __enter__(self) -> SignallingLock:
        if threading.current_thread() is not self.writer_thread:
            self.waiting.set()
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_stop_between_rename_and_link_leaves_no_orphan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = CheckpointWriter(tmp_path, KIND, INSTANCE, "c1")
    lock = writer._lock = SignallingLock(threading.current_thread())  # type: ignore[assignment]
    stopped: dict[str, bool] = {}
    stopper = threading.Thread(target=lambda: stopped.setdefault("published", writer.stop()))
    real_replace = os.replace

    def replace(src, dst):  # noqa: ANN001, ANN202
        real_replace(src, dst)
        if Path(dst).name.startswith("records-"):
            # Right after the rename, a resume stops the write; wait until it is at the lock.
            stopper.start()
            assert lock.waiting.wait(10)

    monkeypatch.setattr(os, "replace", replace)
    manifest = writer.write([record("a"), record("b")])
    stopper.join(10)
    # stop() waited for the publication, which was already decided: it stays, and stop says so.
    assert stopped == {"published": True}
    assert sorted(p.name for p in pdir(tmp_path).iterdir()) == ["manifest.json", manifest["records_file"]]


def test_stop_before_the_rename_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nemo_gym_checkpoint_plugin._storage import WriteStopped
    from nemo_gym_checkpoint_plugin._storage import writer as writer_module

    writer = CheckpointWriter(tmp_path, KIND, INSTANCE, "c1")
    real = writer_module.CheckpointWriter._manifest_tmp

    def manifest_tmp(self, manifest):  # noqa: ANN001, ANN202 - the last step before the locked part
        path = real(self, manifest)
        assert writer.stop() is False
        return path

    monkeypatch.setattr(writer_module.CheckpointWriter, "_manifest_tmp", manifest_tmp)
    with pytest.raises(WriteStopped):
        writer.write([record("a")])
    assert list(pdir(tmp_path).iterdir()) == []
