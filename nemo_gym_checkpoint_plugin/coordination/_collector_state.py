"""The rollout collector's own checkpoint state, on disk beside the Gym records.

A collection checkpoint is one directory per checkpoint id under ``--checkpoint-dir``::

    <checkpoint-dir>/<checkpoint id>/gym/...                    the participants' records and manifests
    <checkpoint-dir>/<checkpoint id>/collector/records-<sha256>.jsonl
    <checkpoint-dir>/<checkpoint id>/collector/manifest.json    written last: the checkpoint is published

The collector's records use the participants' format (docs/protocol.md, "On-disk format"):
one JSON object per row in flight, ``{"episode_id", "state"}`` with ``state`` one of
``continued`` (some participant wrote it), ``restart`` (a participant cannot capture it) or
``uncaptured`` (in flight, but no participant held it yet: it starts over). The manifest is
the participants' manifest (``kind: "collector"``) plus a ``collector`` object: the
deployment it belongs to, the rows finished and where (the output file and its length), the
checkpoint's pause times. Records are streamed, fsynced and named by their digest, the
manifest is hard-linked into place after every parent directory was fsynced, so a crash
leaves a published checkpoint or one without a collector manifest, which is never used.
``--checkpoint-dir`` may be an object-store URL (``s3://bucket/run``): the records are then
uploaded under their digest name and the manifest created exclusively, as a participant's are.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .._errors import InvalidCheckpointState
from .._storage.codec import decode_line, encode_line
from .._storage.files import create_private, make_private_dirs, write_failed
from .._storage.index import check_participants_index
from .._storage.layout import MANIFEST_NAME, SCHEMA_VERSION, records_name
from .._storage.location import Location, child_dirs, lexists, location
from .._storage.objstore import ObjectPath
from .._storage.reader import capture_key_of, iter_verified_lines, load_manifest, read_checkpoint
from .._storage.retention import plan_retention, remove_checkpoint

__all__ = [
    "COLLECTOR_DIR",
    "CHECKPOINT_PREFIX",
    "CollectorState",
    "CheckpointStore",
    "RowState",
]

COLLECTOR_DIR = "collector"
COLLECTOR_KIND = "collector"
COLLECTOR_INSTANCE = "ng-checkpoint-collect"
CHECKPOINT_PREFIX = "collect-"
_CHECKPOINT_NAME = re.compile(r"^collect-(?P<seq>[0-9]{6,})-[0-9a-f]{8}$")
ROW_STATES = ("continued", "restart", "uncaptured")


@dataclass(frozen=True)
class RowState:
    """One row in flight at the checkpoint: its episode attempt and what the checkpoint holds of it."""

    rollout_id: str
    attempt: int
    state: str

    def record(self) -> dict[str, Any]:
        return {"episode_id": {"rollout_id": self.rollout_id, "attempt": self.attempt}, "state": self.state}


@dataclass
class CollectorState:
    """A published (or about to be published) collection checkpoint, as the collector reads it back."""

    checkpoint_id: str
    deployment: dict[str, Any]
    rows: list[RowState] = field(default_factory=list)
    finished: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    path: Location | None = None

    def by_state(self, state: str) -> list[RowState]:
        return [row for row in self.rows if row.state == state]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    """The checkpoints of one collection under ``root`` (absolute, or a URL): naming, writing, reading, pruning."""

    def __init__(self, root: str | Path | ObjectPath, run: str | None = None) -> None:
        self.root = location(root)
        # Servers remember the ids they resumed (stale_checkpoint): each collector process names its own.
        self.run = run or uuid.uuid4().hex[:8]

    # -- names ----------------------------------------------------------------------------------

    def checkpoint_id(self, seq: int) -> str:
        return f"{CHECKPOINT_PREFIX}{seq:06d}-{self.run}"

    @staticmethod
    def seq_of(name: str) -> int | None:
        match = _CHECKPOINT_NAME.match(name)
        return None if match is None else int(match["seq"])

    def path(self, checkpoint_id: str) -> Location:
        return self.root / checkpoint_id

    def entries(self) -> list[tuple[int, Location]]:
        """Every checkpoint directory (published or not), oldest first."""
        if isinstance(self.root, ObjectPath):
            names = child_dirs(self.root)
        else:
            try:
                names = os.listdir(self.root)
            except FileNotFoundError:
                return []
        found = [(seq, self.root / name) for name in names if (seq := self.seq_of(name)) is not None]
        return sorted(found)

    def published(self) -> list[tuple[int, Location]]:
        """Checkpoints whose collector manifest exists, oldest first (not yet verified)."""
        return [(seq, p) for seq, p in self.entries() if lexists(p / COLLECTOR_DIR / MANIFEST_NAME)]

    def next_seq(self) -> int:
        entries = self.entries()
        return entries[-1][0] + 1 if entries else 1

    # -- writing --------------------------------------------------------------------------------

    def write_records(self, state: CollectorState) -> tuple[str, int]:
        """Write the records file (streamed, fsynced, renamed to its digest); returns ``(digest, count)``."""
        directory = self.path(state.checkpoint_id) / COLLECTOR_DIR
        if isinstance(directory, ObjectPath):
            from .._storage.objstore_put import put_records

            return put_records(directory, (encode_line(row.record()) for row in state.rows))
        tmp = directory / f".records.{uuid.uuid4().hex}.tmp"
        try:
            make_private_dirs(directory)
            digest = hashlib.sha256()
            count = 0
            with create_private(tmp) as out:
                for row in state.rows:
                    line = encode_line(row.record())
                    digest.update(line)
                    out.write(line)
                    count += 1
                out.flush()
                os.fsync(out.fileno())
            hexdigest = digest.hexdigest()
            os.replace(tmp, directory / records_name(hexdigest))
            _fsync_dir(directory)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise write_failed(exc, directory, "cannot store the collector state") from None
        return hexdigest, count

    def publish(self, state: CollectorState, digest: str, count: int) -> Location:
        """Create the collector manifest last (hard link, never replacing one), after fsyncing every parent;
        on an object store, created exclusively."""
        checkpoint = self.path(state.checkpoint_id)
        directory = checkpoint / COLLECTOR_DIR
        manifest = {
            "schema_version": SCHEMA_VERSION, "kind": COLLECTOR_KIND, "instance": COLLECTOR_INSTANCE,
            "checkpoint_id": state.checkpoint_id, "records_file": records_name(digest), "records_sha256": digest,
            "record_count": count,
            "collector": {"deployment": state.deployment, "finished": state.finished, "timings": state.timings},
        }
        if isinstance(directory, ObjectPath):
            return _publish_object(directory, manifest)
        tmp = directory / f".manifest.{uuid.uuid4().hex}.tmp"
        try:
            with create_private(tmp) as out:
                out.write(orjson.dumps(manifest) + b"\n")
                out.flush()
                os.fsync(out.fileno())
            # Everything the manifest vouches for is durable before it appears.
            for parent in (directory, checkpoint / "gym", checkpoint, self.root):
                if parent.is_dir():
                    _fsync_dir(parent)
            os.link(tmp, directory / MANIFEST_NAME)
            _fsync_dir(directory)
        except OSError as exc:
            raise write_failed(exc, directory, "cannot publish the collector state") from None
        finally:
            tmp.unlink(missing_ok=True)
        return directory / MANIFEST_NAME

    def prune(self, keep: int) -> list[Location]:
        """Remove what ``keep`` retires (``_storage.retention``, the rule ``ng-checkpoint gc`` applies to
        this collection's checkpoints); returns what was removed.

        Called only after a publish: the ``keep`` newest published checkpoints stay, so do an
        unpublished one newer than the oldest kept (a write in progress) and any under a live lease
        (a restore or commit using it); a removal that fails is left for the next prune.
        """
        plan = plan_retention(self.root, keep, candidates=lambda name: self.seq_of(name) is not None)
        removed = []
        for checkpoint in plan.remove:
            try:
                if remove_checkpoint(checkpoint):
                    removed.append(checkpoint.path)
            except InvalidCheckpointState:
                continue
        return removed

    # -- reading --------------------------------------------------------------------------------

    def read(self, path: Location) -> CollectorState:
        """Read and fully verify a checkpoint: the collector's records and manifest, the participants
        index, and every participant's records. ``InvalidCheckpointState`` naming what is wrong."""
        directory = path / COLLECTOR_DIR
        manifest = load_manifest(directory, kind=COLLECTOR_KIND, instance=COLLECTOR_INSTANCE)
        extras = manifest.get("collector")
        if not isinstance(extras, dict) or not isinstance(extras.get("deployment"), dict):
            raise InvalidCheckpointState(f"{directory}: manifest.json has no collector object")
        rows = []
        # Every line read and the digest checked before any record is trusted.
        lines = list(iter_verified_lines(directory, manifest))
        for number, line in enumerate(lines):
            try:
                record = decode_line(line)
                key = capture_key_of(record.get("episode_id"))
            except (ValueError, AttributeError) as exc:
                raise InvalidCheckpointState(f"{directory}: record {number} is not a row state: {exc}") from None
            if record.get("state") not in ROW_STATES:
                raise InvalidCheckpointState(f"{directory}: record {number} ({key}) has state {record.get('state')!r}")
            episode = record["episode_id"]
            rows.append(RowState(episode["rollout_id"], episode["attempt"], record["state"]))
        index = check_participants_index(path)
        if index is None:
            raise InvalidCheckpointState(f"{path}: no gym/participants.json: the deployment's commit never finished")
        if index["checkpoint_id"] != manifest["checkpoint_id"]:
            raise InvalidCheckpointState(f"{path}: the participants index is of checkpoint {index['checkpoint_id']}")
        for entry in index["participants"]:
            # Every record read and hashed now, so a restore never starts from a damaged file.
            read_checkpoint(path, entry["kind"], entry["instance"], scope=())
        return CollectorState(
            checkpoint_id=manifest["checkpoint_id"], deployment=extras["deployment"], rows=rows,
            finished=dict(extras.get("finished") or {}), timings=dict(extras.get("timings") or {}), path=path,
        )

    def latest(self) -> tuple[CollectorState | None, list[tuple[str, str]]]:
        """The newest published checkpoint that verifies, and ``(checkpoint id, problem)`` of each newer
        one that did not (the fallbacks a resume reports)."""
        skipped: list[tuple[str, str]] = []
        for _seq, path in reversed(self.published()):
            try:
                return self.read(path), skipped
            except InvalidCheckpointState as exc:
                skipped.append((path.name, exc.detail))
        return None, skipped


def _publish_object(directory: ObjectPath, manifest: dict[str, Any]) -> ObjectPath:
    """The collector manifest on an object store: created exclusively (the commit point), never replaced."""
    from .._errors import WriteFailed
    from .._storage.objstore_put import check_exclusive_create, create_exclusive

    check_exclusive_create(directory.parent.parent)
    if not create_exclusive(directory / MANIFEST_NAME, orjson.dumps(manifest) + b"\n"):
        raise WriteFailed(f"{directory / MANIFEST_NAME}: cannot publish the collector state: already exists",
                          path=str(directory / MANIFEST_NAME), cause="already exists")
    return directory / MANIFEST_NAME


def deployment_identity(participants: Iterable[Any], output_path: str | Path) -> dict[str, Any]:
    """What ties a checkpoint to one collection: the participants (kind/instance) and the output file."""
    return {
        "participants": sorted(f"{p.kind}/{p.instance}" for p in participants),
        "output": str(Path(output_path).resolve()),
    }


def identity_mismatch(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """Why a checkpoint's deployment is not this one (in words), or None when it is."""
    problems = []
    if recorded.get("output") != current.get("output"):
        problems.append(f"it collected into {recorded.get('output')}, this run into {current.get('output')}")
    if recorded.get("participants") != current.get("participants"):
        problems.append(f"its participants were {recorded.get('participants')}, this deployment has "
                        f"{current.get('participants')}")
    return "; ".join(problems) or None
