"""Streaming, crash-safe write of one participant's checkpoint.

Order of work, each step durable before the next:

1. the participant directory is created (``0700``, as are the parents this writer creates;
   every file it creates is ``0600``: records hold session data) and locked (shared with
   other writers); a writer alone in it first removes what a dead writer left there (temporary files, and records
   files while no manifest is published);
2. records are encoded, hashed and appended one at a time to a temporary file
   in the participant directory (never the whole file in memory, never a record
   longer than ``max_record_bytes``);
3. the file is fsynced; the manifest is written under a temporary name and fsynced;
4. under the lock ``stop()`` takes: the last stop check, the rename of the records file
   to its digest name ``records-<sha256>.jsonl``, the fsync of the participant directory
   and every parent up to ``checkpoint_dir`` (and above it, as far as this writer created
   directories), and the hard link of the manifest to ``manifest.json``: the link never
   replaces, so of two racing writers exactly one publishes, and a stopped write leaves
   no records file behind.

A directory already holding a manifest of this checkpoint id returns it only when its
``records_sha256`` equals this export's digest (a retry of this very write); any other
manifest there is refused. A crash at any point leaves either a complete checkpoint or
one without a manifest, which a restore refuses. ``stop()`` (a resume) makes the writer
quit before its next record and guarantees no manifest appears after it returned.

Every ``OSError`` while storing is ``WriteFailed`` (its detail names the cause and the
path); a record that cannot be stored at all (not JSON, no ``episode_id``, too big) is a
plain ``InvalidCheckpointState``.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .._errors import InvalidCheckpointState, InvalidPhase, WriteFailed
from .._types import Versioned
from .codec import NotJSON, encode_line, encode_record
from .files import DirectoryLock, create_private, make_private_dirs, remove_leftovers, write_failed
from .increments import Increment, build_versioned, versioned_slot
from .layout import (
    DEFAULT_MAX_RECORD_BYTES,
    MANIFEST_NAME,
    SAFE_COMPONENT,
    build_manifest,
    participant_dir,
)
from .location import Location, location
from .pipeline import HashingWriter
from .reader import capture_key_of, load_manifest
from .segments import History

__all__ = ["CheckpointWriter", "RecordsWriter", "WriteStopped", "fsync_dir"]

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


class RecordsWriter:
    """What both writers share: one participant's records encoded and hashed into a local file, the
    stop, and the checks of a manifest already published. One use per instance.

    ``checkpoint_dir`` and ``directory`` are a ``Path`` in ``CheckpointWriter`` and an ``ObjectPath``
    in ``ObjectStoreWriter``; here they only name the place in messages.
    """

    # Whether the records file is flushed to disk as it is written and fsynced (a spool that is
    # uploaded and removed, ``ObjectStoreWriter``'s, is not).
    _durable = True
    checkpoint_dir: Location
    directory: Location

    def __init__(
        self,
        kind: str,
        instance: str,
        checkpoint_id: str,
        *,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        history: History | None = None,
    ) -> None:
        if not isinstance(checkpoint_id, str) or not SAFE_COMPONENT.fullmatch(checkpoint_id):
            raise InvalidCheckpointState(f"checkpoint id {checkpoint_id!r} is not valid")
        self.kind = kind
        self.instance = instance
        self.checkpoint_id = checkpoint_id
        self.max_record_bytes = max_record_bytes
        self._lock = threading.Lock()
        self._stopped = False
        self._published: dict[str, Any] | None = None
        # The participant's previous published checkpoint (this process's): what an incremental write refers to.
        self._history = history
        self._increment: Increment | None = None

    def _start_increment(self) -> Increment:
        previous = self._history.get(self.kind, self.instance) if self._history is not None else None
        self._increment = Increment(previous, self.checkpoint_dir)
        return self._increment

    def _final_manifest(self, digest: str, count: int, extras: Mapping[str, Any] | None) -> dict[str, Any]:
        full = build_manifest(self.kind, self.instance, self.checkpoint_id, digest, count, extras)
        return full if self._increment is None else self._increment.manifest(full)

    def _check_referred(self) -> None:
        """Just before publishing: every earlier file the manifest refers to is still there."""
        if self._increment is None:
            return
        gone = self._increment.missing(self.directory)
        if gone:
            if self._history is not None:
                self._history.set(self.kind, self.instance, None)  # the retry writes every record
            raise WriteFailed(
                f"{self.directory}: records files this incremental checkpoint refers to were removed while it "
                f"was written ({', '.join(gone[:5])}); retry the commit (it writes every record)",
                path=str(self.directory),
                cause="referenced records removed",
            )

    def _remember(self, manifest: dict[str, Any]) -> None:
        """This write published ``manifest``: the next one of the participant may refer to its records."""
        if self._history is not None and self._increment is not None:
            self._history.set(self.kind, self.instance, self._increment.previous(manifest))

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

    def _same_id(self, manifest: dict) -> dict:
        if manifest["checkpoint_id"] != self.checkpoint_id:
            raise InvalidCheckpointState(
                f"{self.directory} already holds checkpoint {manifest['checkpoint_id']!r}; "
                f"refusing to commit {self.checkpoint_id!r} there"
            )
        return manifest

    def _same_write(self, existing: dict, digest: str) -> dict:
        """``existing`` (of this id) when it is this very write (same records digest); else refuse."""
        if existing["records_sha256"] != digest:
            raise InvalidCheckpointState(
                f"{self.directory} already holds checkpoint {self.checkpoint_id!r} from another write "
                f"(its records_sha256 {existing['records_sha256'][:12]}... differs from this export's "
                f"{digest[:12]}...: a restarted process reusing the id?); refusing to mix them",
                directory=str(self.directory),
            )
        return existing

    def _write_records(self, tmp: Path, records: Iterable[Mapping[str, Any] | Versioned]) -> tuple[str, int]:
        count = 0
        limit = self.max_record_bytes
        with create_private(tmp, buffering=_BUFFER) as out:
            # This thread encodes; the sink hashes, writes and syncs in its own thread.
            sink = HashingWriter(out, durable=self._durable)
            try:
                increment = self._increment
                for item in records:
                    self._check_stop()
                    if type(item) is Versioned:
                        slot = versioned_slot(item, increment, f"{self.kind}/{self.instance}")
                        if increment is not None and increment.refer(slot, item.version):
                            continue
                        record: Any = build_versioned(item, slot)
                    else:
                        record, slot = item, None
                    # A plain dict as a rule: the exact type test first (an ABC check costs more, per record).
                    if type(record) is not dict and not isinstance(record, Mapping) or "episode_id" not in record:
                        raise InvalidCheckpointState(
                            f"record {count} of {self.kind}/{self.instance} is not an object with an episode_id",
                            episode=_episode_key(record),
                        )
                    try:
                        line, _exact = encode_record(record)
                    except NotJSON as exc:
                        key = _episode_key(record)
                        raise InvalidCheckpointState(
                            f"record of episode {key} is not JSON: {exc}", episode=key
                        ) from None
                    if len(line) > limit:
                        key = _episode_key(record)
                        raise InvalidCheckpointState(
                            f"record of episode {key} is {len(line)} bytes encoded, more than max_record_bytes "
                            f"({limit})",
                            episode=key,
                        )
                    if slot is not None and increment is not None:
                        increment.wrote(slot, item.version, count)  # type: ignore[union-attr]
                    sink.write(line)
                    count += 1
                self._check_stop()
                digest = sink.finish()
            except BaseException:
                sink.abort()
                raise
        return digest, count


class CheckpointWriter(RecordsWriter):
    """Writes one participant's records into a directory and publishes its manifest last (a filesystem path)."""

    checkpoint_dir: Path
    directory: Path

    def __init__(
        self,
        checkpoint_dir: str | Path,
        kind: str,
        instance: str,
        checkpoint_id: str,
        *,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        history: History | None = None,
    ) -> None:
        super().__init__(kind, instance, checkpoint_id, max_record_bytes=max_record_bytes, history=history)
        where = location(checkpoint_dir)
        if not isinstance(where, Path):  # the local backends refuse a URL first (``_path_only``)
            raise WriteFailed(f"{checkpoint_dir} is a URL: this writer writes filesystem paths", path=str(where))
        self.checkpoint_dir = where
        self.directory = participant_dir(where, kind, instance)

    # -- the write -----------------------------------------------------------------------------

    def write(self, records: Iterable[Mapping[str, Any]], extras: Mapping[str, Any] | None = None) -> dict:
        """Write every record, then publish the manifest; returns the manifest (the published one
        when this very write, same records digest, was already committed into the directory)."""
        self._check_stop()
        created_up_to = self._make_directories()
        lock = DirectoryLock(self.directory)
        try:
            if lock.acquire():
                remove_leftovers(self.directory, MANIFEST_NAME)
            lock.share()
            # A manifest of another checkpoint id: refused before anything is written.
            self._existing_manifest()
            tmp = self.directory / f".records.{uuid.uuid4().hex}.tmp"
            manifest_tmp: Path | None = None
            try:
                self._start_increment()
                digest, count = self._write_records(tmp, records)
                manifest = self._final_manifest(digest, count, extras)
                manifest_tmp = self._manifest_tmp(manifest)
                self._fsync_parents(created_up_to, include_self=False)
                return self._publish(manifest, tmp, manifest_tmp)
            except OSError as exc:
                raise write_failed(exc, self.directory) from None
            finally:
                for leftover in (tmp, manifest_tmp):
                    if leftover is not None:
                        try:
                            leftover.unlink(missing_ok=True)
                        except OSError:
                            pass
        finally:
            lock.release()

    def _make_directories(self) -> Path:
        """Create the participant directory; return the highest directory whose entry must be fsynced."""
        top = self.checkpoint_dir
        probe = self.checkpoint_dir
        while not probe.exists() and probe.parent != probe:
            top = probe.parent
            probe = probe.parent
        try:
            # Nothing below the checkpoint directory is ever reached through a symbolic link.
            make_private_dirs(self.directory, base=self.checkpoint_dir)
        except FileExistsError as exc:
            raise WriteFailed(
                f"{self.directory} cannot hold checkpoint state: not a directory", path=str(exc.filename)
            ) from None
        except OSError as exc:
            raise write_failed(exc, self.directory, "cannot hold checkpoint state") from None
        if not self.directory.is_dir():
            raise WriteFailed(
                f"{self.directory} cannot hold checkpoint state: not a directory", path=str(self.directory)
            )
        return top

    def _existing_manifest(self) -> dict | None:
        """The manifest published in the directory, refused when it is of another checkpoint id."""
        if not os.path.lexists(self.directory / MANIFEST_NAME):
            return None
        return self._same_id(load_manifest(self.directory, kind=self.kind, instance=self.instance))

    def _fsync_parents(self, top: Path, *, include_self: bool) -> None:
        path = self.directory if include_self else self.directory.parent
        if not include_self and self.directory == top:
            return
        while True:
            fsync_dir(path)
            if path == top or path.parent == path:
                return
            path = path.parent

    def _manifest_tmp(self, manifest: dict) -> Path:
        tmp = self.directory / f".manifest.{uuid.uuid4().hex}.tmp"
        with create_private(tmp) as out:
            out.write(encode_line(manifest))
            out.flush()
            os.fsync(out.fileno())
        return tmp

    def _publish(self, manifest: dict, records_tmp: Path, manifest_tmp: Path) -> dict:
        """Under ``stop()``'s lock: last stop check, rename, directory fsync, link of the manifest."""
        final = self.directory / manifest["records_file"]
        with self._lock:
            self._check_stop()
            existing = self._existing_manifest()
            if existing is not None:
                # Published before this write started or while it ran: ours is dropped either way.
                self._published = self._same_write(existing, manifest["records_sha256"])
                return existing
            self._check_referred()
            os.replace(records_tmp, final)
            try:
                fsync_dir(self.directory)
                os.link(manifest_tmp, self.directory / MANIFEST_NAME)
            except FileExistsError:
                # Another writer published between the look and the link: ours goes unless it is the same file.
                try:
                    existing = load_manifest(self.directory, kind=self.kind, instance=self.instance)
                except InvalidCheckpointState:
                    final.unlink(missing_ok=True)
                    raise
                if existing["records_file"] != final.name:
                    final.unlink(missing_ok=True)
                self._published = self._same_write(self._same_id(existing), manifest["records_sha256"])
                return existing
            except BaseException:
                final.unlink(missing_ok=True)
                raise
            self._published = manifest
        fsync_dir(self.directory)
        self._remember(manifest)
        return manifest
