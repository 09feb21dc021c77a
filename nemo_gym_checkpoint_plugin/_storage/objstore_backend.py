"""The built-in storage backend ``fsspec``: ``checkpoint_dir`` a filesystem path or any fsspec URL.

A URL (``s3://bucket/run``, ``gs://...``, ``file:///...``, ``memory://...``) is written by
``ObjectStoreWriter`` and read by the format's reader through fsspec; a plain path goes to the
``local`` backend, whose POSIX guarantees (fsync, hard-linked manifest) are stronger than
fsspec's local filesystem. Selected with ``checkpoint.storage.backend: fsspec``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Self

from .layout import participant_dir
from .local import LocalStorage
from .location import location
from .objstore import ObjectPath
from .objstore_writer import ObjectStoreWriter
from .reader import RestoredCheckpoint, load_manifest, read_checkpoint
from .writer import CheckpointWriter, RecordsWriter

__all__ = ["FsspecStorage"]


class FsspecStorage(LocalStorage):
    """Storage backend ``fsspec``: object stores through fsspec, local paths as ``local`` does."""

    name = "fsspec"
    spool_dir: str | None = None

    def configured(self, settings: Any) -> Self:
        backend = super().configured(settings)
        backend.spool_dir = getattr(settings, "spool_dir", None)
        return backend

    def open_writer(self, checkpoint_dir: str | Path, kind: str, instance: str, checkpoint_id: str) -> RecordsWriter:
        where = location(checkpoint_dir)
        if isinstance(where, ObjectPath):
            return ObjectStoreWriter(
                where,
                kind,
                instance,
                checkpoint_id,
                max_record_bytes=self.max_record_bytes,
                spool_dir=self.spool_dir,
                history=self.history,
            )
        return CheckpointWriter(
            where, kind, instance, checkpoint_id, max_record_bytes=self.max_record_bytes, history=self.history
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
        return read_checkpoint(
            location(checkpoint_dir),
            kind,
            instance,
            scope=scope,
            validate=validate,
            max_record_bytes=self.max_record_bytes,
        )

    def read_manifest(self, checkpoint_dir: str | Path, kind: str, instance: str) -> dict[str, Any]:
        return load_manifest(participant_dir(location(checkpoint_dir), kind, instance), kind=kind, instance=instance)
