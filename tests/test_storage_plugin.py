"""The built-in storage backend is a core plugin that a user plugin can replace."""

from __future__ import annotations

from pathlib import Path

import pytest
from storage_support import record

from nemo_gym_checkpoint_plugin.markers import hookimpl
from nemo_gym_checkpoint_plugin.plugins import get_storage_backend, make_plugin_manager
from nemo_gym_checkpoint_plugin.storage import LocalStorage


def test_default_backend_is_local_and_round_trips(tmp_path: Path) -> None:
    backend = get_storage_backend(make_plugin_manager(load_entry_points=False), "local")
    assert isinstance(backend, LocalStorage)
    manifest = backend.open_writer(tmp_path, "agent", "simple_agent", "c1").write([record("a", step=2)])
    assert backend.read_manifest(tmp_path, "agent", "simple_agent") == manifest
    assert backend.read(tmp_path, "agent", "simple_agent", scope={"a"}).records == [record("a", step=2)]


def test_unknown_backend_names_the_setting() -> None:
    with pytest.raises(LookupError, match="checkpoint.storage.backend"):
        get_storage_backend(make_plugin_manager(load_entry_points=False), "s3")


class CountingLocal(LocalStorage):
    opened = 0

    def open_writer(self, *args, **kwargs):  # noqa: ANN002, ANN003
        CountingLocal.opened += 1
        return super().open_writer(*args, **kwargs)


class ReplacingPlugin:
    @hookimpl
    def storage_backend(self, name: str) -> LocalStorage | None:
        return CountingLocal() if name == "local" else None


def test_user_plugin_replaces_the_default(tmp_path: Path) -> None:
    backend = get_storage_backend(make_plugin_manager([ReplacingPlugin()], load_entry_points=False), "local")
    assert isinstance(backend, CountingLocal)
    backend.open_writer(tmp_path, "model", "m", "c").write([record("a")])
    assert CountingLocal.opened == 1
