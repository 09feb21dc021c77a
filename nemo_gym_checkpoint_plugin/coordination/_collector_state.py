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
import stat
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .._errors import InvalidCheckpointState
from .._identity import episode_to_wire
from .._storage.codec import decode_line, encode_line
from .._storage.files import create_private, make_private_dirs, write_failed
from .._storage.index import check_participants_index
from .._storage.layout import MANIFEST_NAME, SCHEMA_VERSION, records_name
from .._storage.location import Location, child_dirs, lexists, location
from .._storage.objstore import ObjectPath
from .._storage.reader import capture_key_of, iter_verified_lines, load_manifest, read_checkpoint
from .._storage.retention import Checkpoint, plan_retention, remove_checkpoint

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
_CHECKPOINT_NAME = re.compile(r"^collect-(?P<seq>[0-9]{6,})-(?P<run>[0-9a-f]{8})$")
ROW_STATES = ("continued", "restart", "uncaptured")


@dataclass(frozen=True)
class RowState:
    """One row in flight at the checkpoint: its episode attempt and what the checkpoint holds of it."""

    rollout_id: str
    attempt: int
    state: str
    # The lost-work ledger's figures (coordination._ledger): model calls answered so far, responses held and
    # calls still running at the checkpoint, as the model participants' commit replies said, and tool calls
    # answered, as the resources participants' said; None: none did. ``output_tokens``: the output tokens the
    # answers of those model calls reported (``held_output_tokens``: of the held ones); None: no model server
    # reported tokens at that checkpoint.
    model_calls: int | None = None
    held_calls: int | None = None
    running_calls: int | None = None
    tool_calls: int | None = None
    output_tokens: int | None = None
    held_output_tokens: int | None = None

    def record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"episode_id": episode_to_wire(self), "state": self.state}
        if self.model_calls is not None:
            record["model_calls"] = self.model_calls
            record["held_calls"] = self.held_calls or 0
            record["running_calls"] = self.running_calls or 0
        if self.tool_calls is not None:
            record["tool_calls"] = self.tool_calls
        if self.output_tokens is not None:
            record["output_tokens"] = self.output_tokens
            record["held_output_tokens"] = self.held_output_tokens or 0
        return record


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
    """The checkpoints of one collection under ``root`` (absolute, or a URL): naming, writing, reading, pruning.

    ``collection`` is what names this collection in its checkpoints (the absolute output file, as
    ``deployment_identity`` records it); ``runs`` the runs whose unpublished checkpoints are its own
    (this collector's, and a dead predecessor's it took the directory over from). With a
    ``collection``, ``prune`` removes only this collection's checkpoints, failed attempts included
    (``_storage.retention``: ``belongs`` and ``unpublished_failed``).
    """

    def __init__(self, root: str | Path | ObjectPath, run: str | None = None, *, collection: str | None = None) -> None:
        self.root = location(root)
        # Servers remember the ids they resumed (stale_checkpoint): each collector process names its own.
        self.run = run or uuid.uuid4().hex[:8]
        self.collection = collection
        self.runs: set[str] = {self.run}

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

    def belongs(self, checkpoint: Checkpoint) -> bool:
        """Whether ``checkpoint`` is this collection's (what ``prune`` may ever remove).

        Published: its collector manifest names this collection. Unpublished: its run is one of
        this collection's. A link named like a checkpoint is never this collector's (it makes real
        directories only): someone planted it, and it is left alone.
        """
        if isinstance(checkpoint.path, Path) and checkpoint.path.is_symlink():
            return False
        if checkpoint.published:
            return self._collection_of(checkpoint.path) == self.collection
        match = _CHECKPOINT_NAME.match(checkpoint.name)
        return match is not None and (match["run"] in self.runs or match["run"] in self._published_runs())

    def _published_runs(self) -> set[str]:
        runs = set()
        for _seq, path in self.published():
            match = _CHECKPOINT_NAME.match(path.name)
            if match is not None and self._collection_of(path) == self.collection:
                runs.add(match["run"])
        return runs

    @staticmethod
    def _collection_of(path: Location) -> str | None:
        try:
            manifest = load_manifest(path / COLLECTOR_DIR, kind=COLLECTOR_KIND, instance=COLLECTOR_INSTANCE)
        except InvalidCheckpointState:
            return None
        deployment = (manifest.get("collector") or {}).get("deployment")
        output = deployment.get("output") if isinstance(deployment, dict) else None
        return output if isinstance(output, str) else None

    def published(self) -> list[tuple[int, Location]]:
        """Checkpoints whose collector manifest exists, oldest first (not yet verified)."""
        return [(seq, p) for seq, p in self.entries() if lexists(p / COLLECTOR_DIR / MANIFEST_NAME)]

    def next_seq(self) -> int:
        entries = self.entries()
        return entries[-1][0] + 1 if entries else 1

    # -- writing --------------------------------------------------------------------------------

    def create(self, checkpoint_id: str) -> Location:
        """Make the checkpoint's directory, exclusively, with the root's permissions (the servers write into
        it as the user the root lets write): whatever already is there (a link or a directory another user
        planted in a shared root) fails the attempt instead of being written through. An object store has
        no directories: nothing to make there (its writes are exclusive creates of their own)."""
        root = self.root
        if isinstance(root, ObjectPath):
            return root / checkpoint_id
        path = root / checkpoint_id
        try:
            os.mkdir(path, stat.S_IMODE(os.stat(root).st_mode) & 0o777)
        except FileExistsError:
            raise InvalidCheckpointState(
                f"{path} exists already, and this collector did not make it: refused, never written through"
            ) from None
        except OSError as exc:
            raise write_failed(exc, path, "cannot make the checkpoint directory") from None
        return path

    def write_records(self, state: CollectorState) -> tuple[str, int]:
        """Write the records file (streamed, fsynced, renamed to its digest); returns ``(digest, count)``."""
        root = self.root
        if isinstance(root, ObjectPath):
            from .._storage.objstore_put import put_records

            objects = root / state.checkpoint_id / COLLECTOR_DIR
            return put_records(objects, (encode_line(row.record()) for row in state.rows))
        directory = root / state.checkpoint_id / COLLECTOR_DIR
        tmp = directory / f".records.{uuid.uuid4().hex}.tmp"
        try:
            make_private_dirs(directory, base=root)  # never through a link planted in the root
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
        root = self.root
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "kind": COLLECTOR_KIND,
            "instance": COLLECTOR_INSTANCE,
            "checkpoint_id": state.checkpoint_id,
            "records_file": records_name(digest),
            "records_sha256": digest,
            "record_count": count,
            "collector": {"deployment": state.deployment, "finished": state.finished, "timings": state.timings},
        }
        if isinstance(root, ObjectPath):
            return _publish_object(root / state.checkpoint_id / COLLECTOR_DIR, manifest)
        checkpoint = root / state.checkpoint_id
        directory = checkpoint / COLLECTOR_DIR
        tmp = directory / f".manifest.{uuid.uuid4().hex}.tmp"
        try:
            with create_private(tmp) as out:
                out.write(orjson.dumps(manifest) + b"\n")
                out.flush()
                os.fsync(out.fileno())
            # Everything the manifest vouches for is durable before it appears.
            for parent in (directory, checkpoint / "gym", checkpoint, root):
                if parent.is_dir():
                    _fsync_dir(parent)
            os.link(tmp, directory / MANIFEST_NAME)
            _fsync_dir(directory)
        except OSError as exc:
            raise write_failed(exc, directory, "cannot publish the collector state") from None
        finally:
            tmp.unlink(missing_ok=True)
        return directory / MANIFEST_NAME

    def prune(self, keep: int, in_use: Iterable[Location] = ()) -> list[Location]:
        """Remove what ``keep`` retires (``_storage.retention``, the rule ``ng-checkpoint gc`` applies);
        returns what was removed.

        The ``keep`` newest published checkpoints stay, so does any under a live lease (a restore or
        commit using it) or in ``in_use``; a removal that fails is left for the next prune. With the
        store's ``collection`` (``collect`` always gives it), only this collection's checkpoints are
        considered (``belongs``: another run's are never touched) and its unpublished ones are failed
        attempts, removed whatever their age (the directory lock says no other write is under way);
        without it, an unpublished one newer than the oldest kept is a write in progress and stays.
        """
        mine = self.collection is not None
        plan = plan_retention(
            self.root,
            keep,
            candidates=lambda name: self.seq_of(name) is not None,
            belongs=self.belongs if mine else None,
            unpublished_failed=mine,
            in_use={str(location(path)) for path in in_use},
        )
        removed = []
        for checkpoint in sorted(plan.remove, key=lambda c: c.order):  # oldest first: a cut short keeps the newest
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
        owner = _owner_uid(directory / MANIFEST_NAME)
        if owner is not None and owner != os.getuid():
            # Only this user's collector writes it: another user's is a plant (a root others can write).
            raise InvalidCheckpointState(
                f"{directory}: manifest.json belongs to another user (uid {owner}), not to this collector's"
            )
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
            rows.append(
                RowState(
                    episode["rollout_id"],
                    episode["attempt"],
                    record["state"],
                    model_calls=_count(record.get("model_calls")),
                    held_calls=_count(record.get("held_calls")),
                    running_calls=_count(record.get("running_calls")),
                    tool_calls=_count(record.get("tool_calls")),
                    output_tokens=_count(record.get("output_tokens")),
                    held_output_tokens=_count(record.get("held_output_tokens")),
                )
            )
        index = check_participants_index(path)
        if index is None:
            raise InvalidCheckpointState(f"{path}: no gym/participants.json: the deployment's commit never finished")
        if index["checkpoint_id"] != manifest["checkpoint_id"]:
            raise InvalidCheckpointState(f"{path}: the participants index is of checkpoint {index['checkpoint_id']}")
        for entry in index["participants"]:
            # Every record read and hashed now, so a restore never starts from a damaged file.
            read_checkpoint(path, entry["kind"], entry["instance"], scope=())
        return CollectorState(
            checkpoint_id=manifest["checkpoint_id"],
            deployment=extras["deployment"],
            rows=rows,
            finished=dict(extras.get("finished") or {}),
            timings=dict(extras.get("timings") or {}),
            path=path,
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
        raise WriteFailed(
            f"{directory / MANIFEST_NAME}: cannot publish the collector state: already exists",
            path=str(directory / MANIFEST_NAME),
            cause="already exists",
        )
    return directory / MANIFEST_NAME


def _owner_uid(path: Location) -> int | None:
    """The owner of a file (None on an object store, whose objects have none, or when it cannot be told)."""
    if isinstance(path, ObjectPath):
        return None
    try:
        return os.lstat(path).st_uid
    except OSError:
        return None


def deployment_identity(
    participants: Iterable[Any], output_path: str | Path, input_path: str | Path | None = None
) -> dict[str, Any]:
    """What ties a checkpoint to one collection: the participants (kind/instance), the output and input files."""
    identity: dict[str, Any] = {
        "participants": sorted(f"{p.kind}/{p.instance}" for p in participants),
        "output": str(Path(output_path).resolve()),
    }
    if input_path is not None:
        identity["input"] = str(Path(input_path).resolve())
    return identity


def identity_mismatch(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """Why a checkpoint's deployment is not this one (in words), or None when it is.

    The input is compared when both name one (checkpoints written before it was recorded do not).
    """
    problems = []
    if recorded.get("output") != current.get("output"):
        problems.append(f"it collected into {recorded.get('output')}, this run into {current.get('output')}")
    if "input" in recorded and "input" in current and recorded["input"] != current["input"]:
        problems.append(f"it collected {recorded['input']}, this run {current['input']}")
    if recorded.get("participants") != current.get("participants"):
        problems.append(
            f"its participants were {recorded.get('participants')}, this deployment has {current.get('participants')}"
        )
    return "; ".join(problems) or None


def _count(value: Any) -> int | None:
    """A ledger count of a row record (None: absent, or not a count: the ledger then leaves it out)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
