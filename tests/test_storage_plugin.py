"""The built-in storage backend is a core plugin that a user plugin can replace."""

from __future__ import annotations

from pathlib import Path

import pytest
from storage_support import record

from nemo_gym_checkpoint_plugin._markers import hookimpl
from nemo_gym_checkpoint_plugin._plugins import UnknownStorageBackend, get_storage_backend, make_plugin_manager
from nemo_gym_checkpoint_plugin._settings import SettingsError
from nemo_gym_checkpoint_plugin._storage import LocalStorage


def test_default_backend_is_local_and_round_trips(tmp_path: Path) -> None:
    backend = get_storage_backend(make_plugin_manager(load_entry_points=False), "local")
    assert isinstance(backend, LocalStorage)
    manifest = backend.open_writer(tmp_path, "agent", "simple_agent", "c1").write([record("a", step=2)])
    assert backend.read_manifest(tmp_path, "agent", "simple_agent") == manifest
    assert backend.read(tmp_path, "agent", "simple_agent", scope={"a"}).records == [record("a", step=2)]


def test_unknown_backend_names_the_setting() -> None:
    with pytest.raises(LookupError, match="checkpoint.storage.backend"):
        get_storage_backend(make_plugin_manager(load_entry_points=False), "s3")


class DeclaredBackend:
    storage_backend_names = ("s3-archive",)

    @hookimpl
    def storage_backend(self, name: str) -> LocalStorage | None:
        return None


class UndeclaredBackend:
    @hookimpl
    def storage_backend(self, name: str) -> LocalStorage | None:
        return None


def test_unknown_backend_is_a_settings_error_listing_the_backends_available() -> None:
    pm = make_plugin_manager(
        [DeclaredBackend()], load_entry_points=False, named_plugins={"mystery": UndeclaredBackend()}
    )
    with pytest.raises(UnknownStorageBackend) as refused:
        get_storage_backend(pm, "locl")
    message = str(refused.value)
    assert isinstance(refused.value, SettingsError)
    assert message.startswith("checkpoint.storage.backend: no storage backend named 'locl' (did you mean 'local'?)")
    assert "the backends available: 'fsspec', 'local', 's3-archive'" in message
    assert "plugins that do not list theirs: mystery" in message


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
