"""The built-in storage backend: a local or shared POSIX filesystem.

Registered by the plugin manager as a core plugin (``trylast``), so a plugin that
answers ``storage_backend`` for the same name first replaces it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from .._markers import hookimpl
from .layout import DEFAULT_MAX_RECORD_BYTES, participant_dir
from .reader import RestoredCheckpoint, load_manifest, read_checkpoint
from .writer import CheckpointWriter

__all__ = ["LocalStorage", "LocalStoragePlugin"]


class LocalStorage:
    """Storage backend ``local``: the layout of docs/protocol.md on a filesystem path."""

    name = "local"
    # A class default too: a subclass that does not call ``__init__`` still has the limit.
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES

    def __init__(self, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        self.max_record_bytes = max_record_bytes

    def configured(self, settings: Any) -> LocalStorage:
        """A copy of this backend (of its own class: a plugin may subclass it) with the
        ``checkpoint.storage`` settings applied (``max_record_bytes``)."""
        backend = copy.copy(self)
        backend.max_record_bytes = settings.max_record_bytes
        return backend

    def open_writer(self, checkpoint_dir: str | Path, kind: str, instance: str, checkpoint_id: str) -> CheckpointWriter:
        return CheckpointWriter(checkpoint_dir, kind, instance, checkpoint_id, max_record_bytes=self.max_record_bytes)

    def read(
        self,
        checkpoint_dir: str | Path,
        kind: str,
        instance: str,
        *,
        scope: Collection[str] | None = None,
        validate: Callable[[dict[str, Any]], None] | None = None,
    ) -> RestoredCheckpoint:
        return read_checkpoint(
            checkpoint_dir, kind, instance, scope=scope, validate=validate, max_record_bytes=self.max_record_bytes
        )

    def read_manifest(self, checkpoint_dir: str | Path, kind: str, instance: str) -> dict[str, Any]:
        return load_manifest(participant_dir(checkpoint_dir, kind, instance), kind=kind, instance=instance)


class LocalStoragePlugin:
    """Core plugin answering ``storage_backend("local")``."""

    # Listed when a configured backend name is unknown (plugins.storage_backend_names).
    storage_backend_names = (LocalStorage.name,)

    def __init__(self) -> None:
        self._backend = LocalStorage()

    @hookimpl(trylast=True)
    def storage_backend(self, name: str) -> LocalStorage | None:
        return self._backend if name == LocalStorage.name else None
