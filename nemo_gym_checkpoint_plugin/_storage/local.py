"""The built-in storage backends: ``local`` (a local or shared POSIX filesystem) and ``fsspec``.

Registered by the plugin manager as a core plugin (``trylast``), so a plugin that
answers ``storage_backend`` for the same name first replaces it. ``local`` refuses a
``checkpoint_dir`` that is a URL (``s3://...``), naming the backend that writes one:
``fsspec`` (``objstore_backend``), loaded only when selected.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Self

from .._errors import WriteFailed
from .._markers import hookimpl
from .layout import DEFAULT_MAX_RECORD_BYTES, participant_dir
from .objstore import is_url
from .reader import RestoredCheckpoint, load_manifest, read_checkpoint
from .segments import History
from .writer import CheckpointWriter, RecordsWriter

__all__ = ["LocalStorage", "LocalStoragePlugin"]


class LocalStorage:
    """Storage backend ``local``: the layout of docs/protocol.md on a filesystem path."""

    name = "local"
    # A class default too: a subclass that does not call ``__init__`` still has the limit.
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES

    # Each participant's previous published checkpoint, for incremental writes (shared by the copies
    # ``configured`` makes; a subclass that does not call ``__init__`` writes full checkpoints).
    history: History | None = None

    def __init__(self, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        self.max_record_bytes = max_record_bytes
        self.history = History()

    def configured(self, settings: Any) -> Self:
        """A copy of this backend (of its own class: a plugin may subclass it) with the
        ``checkpoint.storage`` settings applied (``max_record_bytes``)."""
        backend = copy.copy(self)
        backend.max_record_bytes = settings.max_record_bytes
        return backend

    def open_writer(self, checkpoint_dir: str | Path, kind: str, instance: str, checkpoint_id: str) -> RecordsWriter:
        _path_only(checkpoint_dir)
        return CheckpointWriter(
            checkpoint_dir, kind, instance, checkpoint_id, max_record_bytes=self.max_record_bytes, history=self.history
        )

    def read(
        self,
        checkpoint_dir: str | Path,
        kind: str,
        instance: str,
        *,
        scope: Collection[str] | None = None,
        validate: Callable[[dict[str, Any]], None] | None = None,
    ) -> RestoredCheckpoint:
        _path_only(checkpoint_dir)
        return read_checkpoint(
            checkpoint_dir, kind, instance, scope=scope, validate=validate, max_record_bytes=self.max_record_bytes
        )

    def read_manifest(self, checkpoint_dir: str | Path, kind: str, instance: str) -> dict[str, Any]:
        _path_only(checkpoint_dir)
        return load_manifest(participant_dir(checkpoint_dir, kind, instance), kind=kind, instance=instance)


def _path_only(checkpoint_dir: object) -> None:
    """``local`` writes filesystem paths; a URL would become a relative directory named ``s3:``."""
    if is_url(checkpoint_dir):
        # A WriteFailed: the export is kept, so a retried commit into a path (or after a fix) still works.
        raise WriteFailed(
            f"{checkpoint_dir} is a URL: the storage backend 'local' writes filesystem paths only; set "
            "checkpoint.storage.backend: fsspec (and install the URL's filesystem, e.g. s3fs) to use an object store",
            path=str(checkpoint_dir),
            cause="url needs the fsspec backend",
        )


class LocalStoragePlugin:
    """Core plugin answering ``storage_backend("local")`` and ``storage_backend("fsspec")``."""

    # Listed when a configured backend name is unknown (plugins.storage_backend_names).
    storage_backend_names = (LocalStorage.name, "fsspec")

    def __init__(self) -> None:
        self._backend = LocalStorage()
        self._fsspec: LocalStorage | None = None

    @hookimpl(trylast=True)
    def storage_backend(self, name: str) -> LocalStorage | None:
        if name == LocalStorage.name:
            return self._backend
        if name == "fsspec":
            if self._fsspec is None:
                from .objstore_backend import FsspecStorage

                self._fsspec = FsspecStorage()
            return self._fsspec
        return None
