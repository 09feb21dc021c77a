"""Checkpoint files are readable by their owner only: records hold session data.

Files the storage creates (records, manifests, ``participants.json``) are ``0600``; the
directories it creates are ``0700``; a directory that already existed keeps its mode.
The modes are read back with ``os.stat`` (root ignores them, but they are still set).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from storage_support import record, write

from nemo_gym_checkpoint_plugin._storage.files import create_private, make_private_dirs
from nemo_gym_checkpoint_plugin._storage.index import index_path, write_participants_index
from nemo_gym_checkpoint_plugin._storage.layout import MANIFEST_NAME, participant_dir


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(params=[0o022, 0o000], ids=["umask-022", "umask-000"])
def umask(request: pytest.FixtureRequest):  # noqa: ANN201
    # A permissive umask must not widen the modes (a stricter one is the operator's business).
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def test_records_and_manifest_are_owner_only_and_created_directories_0700(tmp_path: Path, umask: int) -> None:
    root = tmp_path / "new" / "checkpoints"
    manifest = write(root, [record("a", step=1), record("b", step=2)])
    directory = participant_dir(root, "model", "policy_model")
    assert _mode(directory / manifest["records_file"]) == 0o600
    assert _mode(directory / MANIFEST_NAME) == 0o600
    for created in (tmp_path / "new", root, root / "gym", root / "gym" / "model", directory):
        assert _mode(created) == 0o700, created
    # Nothing else is left in the directory: the temporary files were renamed and linked, not copied.
    assert sorted(p.name for p in directory.iterdir()) == sorted([manifest["records_file"], MANIFEST_NAME])


def test_participants_index_is_owner_only(tmp_path: Path, umask: int) -> None:
    manifest = write(tmp_path, [record("a")])
    entry = {"kind": "model", "instance": "policy_model", "records_sha256": manifest["records_sha256"]}
    write_participants_index(tmp_path, "step-1", [entry])
    assert _mode(index_path(tmp_path)) == 0o600


def test_participants_index_creates_its_directory_0700(tmp_path: Path, umask: int) -> None:
    root = tmp_path / "controller-only"
    write_participants_index(root, "step-1", [])
    assert _mode(root) == 0o700 and _mode(root / "gym") == 0o700
    assert _mode(index_path(root)) == 0o600


def test_an_existing_directory_keeps_its_mode(tmp_path: Path, umask: int) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o755)
    write(root, [record("a")])
    assert _mode(root) == 0o755
    assert _mode(root / "gym") == 0o700


def test_create_private_never_follows_a_symlink_nor_replaces(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(FileExistsError):
        create_private(tmp_path / "link")
    with pytest.raises(FileExistsError):
        create_private(target)
    assert target.read_bytes() == b"keep"


def test_make_private_dirs_refuses_a_file_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(FileExistsError):
        make_private_dirs(tmp_path / "file")
    with pytest.raises(NotADirectoryError):
        make_private_dirs(tmp_path / "file" / "below")
