"""Tampered, special and duplicate checkpoint directories: the reader and ``verify`` never hang, never raise
anything but ``InvalidCheckpointState``, and never leak a file descriptor."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from storage_support import fd_count, record
from test_storage_hostile import bounded

from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState
from nemo_gym_checkpoint_plugin._storage import CheckpointWriter, read_checkpoint
from nemo_gym_checkpoint_plugin._storage.index import check_participants_index, write_participants_index
from nemo_gym_checkpoint_plugin.cli._offline import inspect_checkpoint, verify_checkpoint

PARTICIPANTS = [("environment", "env"), ("model", "m"), ("agent", "a")]
TARGETS = ["manifest", "records", "index"]


def build(root: Path) -> None:
    manifests = [
        CheckpointWriter(root, kind, instance, "c1").write(
            [record(f"r{i}", big=2**70 if i == 1 else i, text="t" * 50) for i in range(4)]
        )
        for kind, instance in PARTICIPANTS
    ]
    write_participants_index(root, "c1", [{k: m[k] for k in ("kind", "instance", "records_sha256")} for m in manifests])


def path_of(root: Path, target: str, which: int) -> Path:
    if target == "index":
        return root / "gym" / "participants.json"
    kind, instance = PARTICIPANTS[which]
    directory = root / "gym" / kind / instance
    if target == "manifest":
        return directory / "manifest.json"
    manifest = directory / "manifest.json"
    if not manifest.is_file():  # never read a FIFO here: the test itself would block
        raise ValueError("no readable manifest")
    path = directory / orjson.loads(manifest.read_bytes())["records_file"]
    if not path.resolve().is_relative_to(root.resolve()):  # a mangled name never sends the test elsewhere
        raise ValueError("outside the checkpoint")
    return path


def replace_with(path: Path, how: str, data: bytes, position: int) -> None:
    if how == "append":
        with open(path, "ab") as out:
            out.write(data)
        return
    if how == "duplicate_line":
        lines = path.read_bytes().splitlines(keepends=True)
        if lines:  # an earlier mutation may have truncated it to nothing: no line to repeat
            path.write_bytes(b"".join([*lines, lines[position % len(lines)]]))
        return
    if how == "flip":
        body = bytearray(path.read_bytes())
        if body:
            body[position % len(body)] ^= 1 << (position % 8)
        path.write_bytes(bytes(body))
        return
    if how == "truncate":
        body = path.read_bytes()
        path.write_bytes(body[: position % (len(body) + 1)])
        return
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
    if how == "fifo":
        os.mkfifo(path)
    elif how == "directory":
        path.mkdir()
    elif how == "symlink_out":
        path.symlink_to("/dev/zero")
    elif how == "symlink_fifo":
        os.mkfifo(path.with_name(".fifo"))
        path.symlink_to(".fifo")
    elif how == "bytes":
        path.write_bytes(data)


def tamper(path: Path, how: str, data: bytes, position: int) -> None:
    """``replace_with`` where the mutation applies to what is there now; otherwise leave ``path`` alone."""
    if not os.path.lexists(path) and how not in ("remove", "fifo", "directory", "bytes"):
        return
    if os.path.lexists(path) and not path.is_file() and how in ("append", "duplicate_line", "flip", "truncate"):
        return
    try:
        replace_with(path, how, data, position)
    except OSError:
        return


MUTATION = st.tuples(
    st.sampled_from(TARGETS),
    st.integers(0, len(PARTICIPANTS) - 1),
    st.sampled_from(
        [
            "append",
            "duplicate_line",
            "flip",
            "truncate",
            "remove",
            "fifo",
            "directory",
            "symlink_out",
            "symlink_fifo",
            "bytes",
        ]
    ),
    st.binary(max_size=200)
    | st.sampled_from(
        [b"\n", b"{}\n", b'{"episode_id":{"rollout_id":"r0","attempt":0}}\n', b"null", b"[]", b"7" * 300]
    ),
    st.integers(0, 10_000),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3))
def test_tampered_directories_are_refused_cleanly(mutations: list) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build(root)
        for target, which, how, data, position in mutations:
            try:
                path = path_of(root, target, which)
            except (OSError, ValueError, KeyError, TypeError):
                continue  # the manifest naming the records file is already gone or mangled
            tamper(path, how, data, position)
        before = fd_count()

        def read_everything() -> list[BaseException]:
            problems: list[BaseException] = []
            for kind, instance in PARTICIPANTS:
                try:
                    read_checkpoint(root, kind, instance)
                except InvalidCheckpointState:
                    pass
                except BaseException as exc:  # noqa: BLE001 - collected to fail the test
                    problems.append(exc)
            for call in (
                lambda: check_participants_index(root),
                lambda: verify_checkpoint(root),
                lambda: inspect_checkpoint(root, episodes=True),
            ):
                try:
                    call()
                except InvalidCheckpointState:
                    pass
                except BaseException as exc:  # noqa: BLE001
                    problems.append(exc)
            return problems

        assert bounded(read_everything) == []
        assert fd_count() == before
