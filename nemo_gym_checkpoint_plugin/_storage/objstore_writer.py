"""Streaming write of one participant's checkpoint into an object store (docs/protocol.md, "Object stores").

There is no rename on an object store, so the records object is written under its digest name,
and the digest is known only once every record is encoded. Order of work:

1. the store is probed (once per process and bucket) to refuse a second exclusive create, and a
   manifest of another checkpoint id in the participant's prefix is refused, before anything
   is written;
2. records are encoded, hashed and appended one at a time to a local spool file (``0600``, in
   ``checkpoint.storage.spool_dir`` or the system's temporary directory; never the whole file
   in memory, never a record longer than ``max_record_bytes``);
3. the spool is uploaded as ``records-<sha256>.jsonl`` (multipart, parts in parallel, for a
   large one: an idempotent write, since the name is the content's digest), and its size
   checked on the store;
4. under the lock ``stop()`` takes: the last stop check and the exclusive create of
   ``manifest.json``: of two racing writers exactly one creates it, and no manifest appears
   after ``stop()`` returned.

An acknowledged PUT is durable, so no step needs a sync. A crash at any point leaves a complete
checkpoint or a prefix without a manifest, which a restore refuses; a records object no
manifest references is reported by ``verify`` and removed with its checkpoint by ``gc``. The
spool file is removed on every path; a dead process's spool files are removed by the next
write in the same spool directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .._errors import InvalidCheckpointState, WriteFailed
from .._process import pid_alive
from .files import write_failed
from .layout import DEFAULT_MAX_RECORD_BYTES, MANIFEST_NAME, participant_dir
from .location import lexists, location
from .objstore import ObjectPath, size
from .objstore import write_failed as object_write_failed
from .objstore_put import check_exclusive_create, create_exclusive, remove, upload
from .reader import load_manifest
from .segments import History
from .writer import RecordsWriter

__all__ = ["ObjectStoreWriter", "remove_dead_spools"]

_SPOOL = re.compile(r"^\.ng-checkpoint-spool-(?P<pid>[0-9]+)-[0-9a-f]{32}\.jsonl$")


def remove_dead_spools(spool_dir: Path) -> list[str]:
    """Remove the spool files of processes that are gone (killed while writing); the names removed."""
    removed: list[str] = []
    try:
        names = os.listdir(spool_dir)
    except OSError:
        return removed
    for name in names:
        match = _SPOOL.fullmatch(name)
        if match is None or int(match["pid"]) == os.getpid() or pid_alive(int(match["pid"])):
            continue
        with contextlib.suppress(OSError):
            os.unlink(spool_dir / name)
            removed.append(name)
    return removed


class ObjectStoreWriter(RecordsWriter):
    """``CheckpointWriter``'s contract on an fsspec URL: records under their digest name, manifest created last."""

    _durable = False  # the spool: uploaded, then removed
    checkpoint_dir: ObjectPath
    directory: ObjectPath

    def __init__(
        self,
        checkpoint_dir: str | ObjectPath,
        kind: str,
        instance: str,
        checkpoint_id: str,
        *,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        spool_dir: str | Path | None = None,
        history: History | None = None,
    ) -> None:
        super().__init__(kind, instance, checkpoint_id, max_record_bytes=max_record_bytes, history=history)
        where = location(checkpoint_dir)
        if not isinstance(where, ObjectPath):
            raise InvalidCheckpointState(f"{checkpoint_dir} is not an object-store URL")
        self.checkpoint_dir = where
        self.directory = participant_dir(where, kind, instance)
        self.spool_dir = Path(spool_dir) if spool_dir is not None else Path(tempfile.gettempdir())

    def write(self, records: Iterable[Mapping[str, Any]], extras: Mapping[str, Any] | None = None) -> dict:
        self._check_stop()
        check_exclusive_create(self.checkpoint_dir)
        # A manifest of another checkpoint id: refused before anything is written.
        self._existing_manifest()
        remove_dead_spools(self.spool_dir)
        spool = self.spool_dir / f".ng-checkpoint-spool-{os.getpid()}-{uuid.uuid4().hex}.jsonl"
        try:
            try:
                self._start_increment()
                digest, count = self._write_records(spool, records)
                spooled = os.path.getsize(spool)
            except OSError as exc:
                raise write_failed(exc, spool, "cannot spool the checkpoint before its upload") from None
            manifest = self._final_manifest(digest, count, extras)
            existing = self._existing_manifest()
            if existing is not None:
                # This very export was published already (a retried commit): nothing to upload.
                with self._lock:
                    self._check_stop()
                    self._published = self._same_write(existing, digest)
                    return existing
            self._check_stop()
            return self._upload_and_publish(manifest, spool, spooled)
        finally:
            with contextlib.suppress(OSError):
                spool.unlink(missing_ok=True)

    def _existing_manifest(self) -> dict | None:
        try:
            present = lexists(self.directory / MANIFEST_NAME)
        except InvalidCheckpointState as exc:
            # The store did not answer (not a bad checkpoint): a failed write, the export kept for a retry.
            raise WriteFailed(
                f"{self.directory}: cannot look for a published manifest: {exc.detail}",
                path=str(self.directory),
                cause="store unavailable",
            ) from None
        if not present:
            return None
        return self._same_id(load_manifest(self.directory, kind=self.kind, instance=self.instance))

    def _upload_and_publish(self, manifest: dict, spool: Path, spooled: int) -> dict:
        records = self.directory / manifest["records_file"]
        published = False
        try:
            upload(str(spool), records)
            stored = size(records)
            if stored != spooled:
                # A store that acknowledged the upload and holds something else: never vouch for it.
                raise WriteFailed(
                    f"{records}: the store holds {stored} bytes after the upload of {spooled}",
                    path=str(records),
                    cause="upload not stored whole",
                )
            with self._lock:
                self._check_stop()
                self._check_referred()
                try:
                    created = create_exclusive(self.directory / MANIFEST_NAME, _manifest_bytes(manifest))
                except WriteFailed:
                    raise
                except Exception as exc:  # never untyped: the commit replies invalid_checkpoint_state
                    raise object_write_failed(exc, self.directory / MANIFEST_NAME) from None
                if created:
                    self._published = manifest
                    published = True
                    self._remember(manifest)
                    return manifest
                # Another writer created it between the look and the create: ours goes unless it is the same.
                existing = load_manifest(self.directory, kind=self.kind, instance=self.instance)
                published = existing["records_file"] == records.name
                self._published = self._same_write(self._same_id(existing), manifest["records_sha256"])
                return existing
        finally:
            if not published:
                # Unreferenced (stopped, refused, or failed before the manifest): not left behind.
                with contextlib.suppress(WriteFailed):
                    remove(records)


def _manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    from .codec import encode_line

    return encode_line(dict(manifest))
