"""Write failures are ``WriteFailed`` naming the cause and the path; export errors stay plain; the storage
executor and the configured record bound reach the control plane."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from pathlib import Path

import pytest
from storage_support import record, write

from nemo_gym_checkpoint_plugin._control import ControlPlane
from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState, WriteFailed
from nemo_gym_checkpoint_plugin._plugins import make_plugin_manager
from nemo_gym_checkpoint_plugin._settings import CheckpointSettings, SettingsError, settings_from_global_config
from nemo_gym_checkpoint_plugin._storage import writer as writer_module
from nemo_gym_checkpoint_plugin._storage.executor import STORAGE_THREADS, run_storage

PDIR = ("gym", "model", "policy_model")


@pytest.mark.parametrize(
    ("target", "code", "words"),
    [
        ("fsync", errno.ENOSPC, "no space left on device"),
        ("replace", errno.EROFS, "read-only filesystem"),
        ("link", errno.EACCES, "permission denied"),
        ("link", errno.EDQUOT, "disk quota exceeded"),
    ],
)
def test_every_os_failure_while_storing_is_write_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, code: int, words: str
) -> None:
    def fail(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError(code, os.strerror(code), str(args[0]) if args and isinstance(args[0], (str, Path)) else None)

    monkeypatch.setattr(os, target, fail)
    with pytest.raises(WriteFailed, match=words) as refused:
        write(tmp_path, [record("a")])
    monkeypatch.undo()
    assert refused.value.data["cause"] == words
    assert str(tmp_path) in refused.value.detail
    # Nothing published, nothing left behind.
    assert [p.name for p in tmp_path.joinpath(*PDIR).iterdir()] == []


def test_a_full_disk_while_writing_records_is_write_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_create = writer_module.create_private

    def create_full(path, buffering=-1):  # noqa: ANN001, ANN202
        if Path(path).name.startswith(".records."):
            real_create(path).close()  # the temporary name exists, as it would
            return open("/dev/full", "wb", buffering=buffering)
        return real_create(path, buffering)

    monkeypatch.setattr(writer_module, "create_private", create_full)
    with pytest.raises(WriteFailed, match="no space left on device"):
        write(tmp_path, [record(f"r{i}", blob="x" * 100_000) for i in range(200)])
    assert [p.name for p in tmp_path.joinpath(*PDIR).iterdir()] == []


def test_directories_that_cannot_hold_state_are_write_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("a file")
    with pytest.raises(WriteFailed, match="not a directory"):
        write(tmp_path / "file" / "ckpt", [record("a")])

    def read_only(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(WriteFailed, match=f"{tmp_path / 'ro'}.*read-only filesystem"):
        write(tmp_path / "ro", [record("a")])


@pytest.mark.parametrize(
    ("records", "writer_kwargs"),
    [
        ([record("a", when=object())], {}),  # not JSON
        ([{"no_episode_id": 1}], {}),  # no episode_id
        ([record("a", blob="x" * 500)], {"max_record_bytes": 100}),  # too big
    ],
)
def test_export_errors_stay_plain_invalid_checkpoint_state(tmp_path: Path, records, writer_kwargs) -> None:
    writer = writer_module.CheckpointWriter(tmp_path, "model", "policy_model", "c1", **writer_kwargs)
    with pytest.raises(InvalidCheckpointState) as refused:
        writer.write(records)
    assert type(refused.value) is InvalidCheckpointState


# -- the storage executor ----------------------------------------------------------------------------------------


async def test_stuck_storage_calls_do_not_starve_the_default_executor() -> None:
    release = threading.Event()
    names: list[str] = []

    def stuck() -> None:
        names.append(threading.current_thread().name)
        release.wait(30)

    held = [asyncio.ensure_future(run_storage(stuck)) for _ in range(STORAGE_THREADS + 2)]
    try:
        # Every storage thread is stuck; work on the loop's default pool still runs at once.
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 42), 10) == 42
    finally:
        release.set()
        await asyncio.gather(*held)
    assert all(name.startswith("checkpoint-storage") for name in names)


async def test_commit_and_restore_run_storage_on_the_storage_threads(tmp_path: Path) -> None:
    from control_support import close_harness, make_harness

    from nemo_gym_checkpoint_plugin._markers import hookimpl
    from nemo_gym_checkpoint_plugin._storage import LocalStorage

    threads: dict[str, str] = {}

    class Recording(LocalStorage):
        def open_writer(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            writer = super().open_writer(*args, **kwargs)
            real = writer.write

            def write_(*a, **k):  # noqa: ANN002, ANN003, ANN202
                threads["write"] = threading.current_thread().name
                return real(*a, **k)

            writer.write = write_
            return writer

        def read(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            threads["read"] = threading.current_thread().name
            return super().read(*args, **kwargs)

    class Plugin:
        @hookimpl
        def storage_backend(self, name: str):  # noqa: ANN202
            return Recording() if name == "local" else None

    h = await make_harness(tmp_path, extra_plugins=(Plugin(),))
    try:
        h.participant.add("r1")
        await h.checkpoint("c1", ["r1"])
        await h.call("resume", checkpoint_id="c1")
        await h.call(
            "restore",
            checkpoint_id="re-1",
            checkpoint_dir=str(h.directory),
            episode_ids=[{"rollout_id": "r1", "attempt": 0}],
        )
    finally:
        await close_harness(h)
    assert threads["write"].startswith("checkpoint-storage"), threads
    assert threads["read"].startswith("checkpoint-storage"), threads


# -- the configured bound ----------------------------------------------------------------------------------------


def test_max_record_bytes_is_validated_and_reaches_the_backend() -> None:
    with pytest.raises(SettingsError, match="checkpoint.storage.max_record_bytes"):
        settings_from_global_config({"checkpoint": {"storage": {"max_record_bytes": 0}}})
    settings = settings_from_global_config({"checkpoint": {"enabled": True, "storage": {"max_record_bytes": 4096}}})
    plane = ControlPlane(make_plugin_manager(load_entry_points=False), kind="model", instance="m", settings=settings)
    assert plane.storage.max_record_bytes == 4096
    assert CheckpointSettings().storage.max_record_bytes == 64 << 20
