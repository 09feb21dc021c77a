"""Streaming, crash-safe write of one participant's checkpoint.

Order of work, each step durable before the next:

1. records are encoded, hashed and appended one at a time to a temporary file
   in the participant directory (never the whole file in memory);
2. the file is fsynced and renamed to its digest name ``records-<sha256>.jsonl``;
3. the participant directory and every parent up to ``checkpoint_dir`` (and
   above it, as far as this writer created directories) are fsynced;
4. the manifest is written under a temporary name, fsynced, and hard-linked to
   ``manifest.json``: the link never replaces, so of two racing writers exactly
   one publishes.

A crash at any point leaves either a complete checkpoint or one without a
manifest, which a restore refuses. ``stop()`` (a resume) makes the writer quit
before its next record and guarantees no manifest appears after it returned.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import InvalidCheckpointState, InvalidPhase
from .codec import NotJSON, encode_line, encode_record
from .layout import EXACT_LINES, MANIFEST_NAME, SAFE_COMPONENT, SCHEMA_VERSION, participant_dir, records_name
from .pipeline import HashingWriter
from .reader import capture_key_of, load_manifest

__all__ = ["CheckpointWriter", "WriteStopped", "fsync_dir"]

_BUFFER = 1 << 20


class WriteStopped(InvalidPhase):
    """The checkpoint was resumed while its write ran; nothing was published."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _episode_key(record: Any) -> str:
    try:
        return capture_key_of(record["episode_id"])
    except Exception:
        return "<no valid episode_id>"


class CheckpointWriter:
    """Writes one participant's records and publishes its manifest last. One use per instance."""

    def __init__(self, checkpoint_dir: str | Path, kind: str, instance: str, checkpoint_id: str) -> None:
        if not isinstance(checkpoint_id, str) or not SAFE_COMPONENT.fullmatch(checkpoint_id):
            raise InvalidCheckpointState(f"checkpoint id {checkpoint_id!r} is not valid")
        self.checkpoint_dir = Path(checkpoint_dir)
        self.kind = kind
        self.instance = instance
        self.checkpoint_id = checkpoint_id
        self.directory = participant_dir(checkpoint_dir, kind, instance)
        self._lock = threading.Lock()
        self._stopped = False
        self._published: dict[str, Any] | None = None

    # -- control -------------------------------------------------------------------------------

    def stop(self) -> bool:
        """Stop the write. Returns True when the manifest was already published (it then stays)."""
        with self._lock:
            self._stopped = True
            return self._published is not None

    @property
    def stopped(self) -> bool:
        return self._stopped

    def _check_stop(self) -> None:
        if self._stopped:
            raise WriteStopped(
                f"checkpoint {self.checkpoint_id} was resumed while its write ran; no manifest was published"
            )

    # -- the write -----------------------------------------------------------------------------

    def write(self, records: Iterable[Mapping[str, Any]], extras: Mapping[str, Any] | None = None) -> dict:
        """Write every record, then publish the manifest; returns the manifest (an existing one if
        this very checkpoint was already committed into the directory)."""
        self._check_stop()
        created_up_to = self._make_directories()
        existing = self._existing_manifest()
        if existing is not None:
            return existing
        tmp = self.directory / f".records.{uuid.uuid4().hex}.tmp"
        try:
            digest, count, exact = self._write_records(tmp, records)
            final = self.directory / records_name(digest)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._fsync_parents(created_up_to)
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "kind": self.kind,
            "instance": self.instance,
            "checkpoint_id": self.checkpoint_id,
            "records_file": final.name,
            "records_sha256": digest,
            "record_count": count,
            # Storage extra: lines only an exact JSON reader decodes faithfully (big integers, NaN,
            # infinities). 0 lets a reader skip looking for them; absent (other writers), it looks.
            EXACT_LINES: exact,
        }
        for key, value in (extras or {}).items():
            if key in manifest:
                raise InvalidCheckpointState(f"manifest extra {key!r} would replace a protocol field")
            manifest[key] = value
        return self._publish(manifest, final)

    def _make_directories(self) -> Path:
        """Create the participant directory; return the highest directory whose entry must be fsynced."""
        top = self.checkpoint_dir
        probe = self.checkpoint_dir
        while not probe.exists() and probe.parent != probe:
            top = probe.parent
            probe = probe.parent
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidCheckpointState(f"{self.directory} cannot hold checkpoint state: {exc.strerror}") from None
        if not self.directory.is_dir():
            raise InvalidCheckpointState(f"{self.directory} cannot hold checkpoint state: not a directory")
        return top

    def _existing_manifest(self) -> dict | None:
        if not (self.directory / MANIFEST_NAME).exists():
            return None
        manifest = load_manifest(self.directory, kind=self.kind, instance=self.instance)
        if manifest["checkpoint_id"] != self.checkpoint_id:
            raise InvalidCheckpointState(
                f"{self.directory} already holds checkpoint {manifest['checkpoint_id']!r}; "
                f"refusing to commit {self.checkpoint_id!r} there"
            )
        return manifest

    def _write_records(self, tmp: Path, records: Iterable[Mapping[str, Any]]) -> tuple[str, int, int]:
        count = exact = 0
        with open(tmp, "xb", buffering=_BUFFER) as out:
            # This thread encodes; the sink hashes, writes and syncs in its own thread.
            sink = HashingWriter(out)
            try:
                for record in records:
                    self._check_stop()
                    if not isinstance(record, Mapping) or "episode_id" not in record:
                        raise InvalidCheckpointState(
                            f"record {count} of {self.kind}/{self.instance} is not an object with an episode_id",
                            episode=_episode_key(record),
                        )
                    try:
                        line, needs_exact = encode_record(record)
                    except NotJSON as exc:
                        key = _episode_key(record)
                        raise InvalidCheckpointState(
                            f"record of episode {key} is not JSON: {exc}", episode=key
                        ) from None
                    sink.write(line)
                    count += 1
                    exact += needs_exact
                self._check_stop()
                digest = sink.finish()
            except BaseException:
                sink.abort()
                raise
        return digest, count, exact

    def _fsync_parents(self, top: Path) -> None:
        path = self.directory
        while True:
            fsync_dir(path)
            if path == top or path.parent == path:
                return
            path = path.parent

    def _publish(self, manifest: dict, records_file: Path) -> dict:
        body = encode_line(manifest)
        tmp = self.directory / f".manifest.{uuid.uuid4().hex}.tmp"
        with open(tmp, "xb") as out:
            out.write(body)
            out.flush()
            os.fsync(out.fileno())
        try:
            with self._lock:
                self._check_stop()
                try:
                    os.link(tmp, self.directory / MANIFEST_NAME)
                except FileExistsError:
                    # Another writer published first: keep its records file, drop ours if it differs.
                    try:
                        existing = self._existing_manifest()
                    finally:
                        published = load_manifest(self.directory)["records_file"]
                        if published != records_file.name:
                            records_file.unlink(missing_ok=True)
                    assert existing is not None
                    self._published = existing
                    return existing
                self._published = manifest
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(self.directory)
        return manifest
