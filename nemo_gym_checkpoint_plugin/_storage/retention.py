"""Retention: which checkpoints of a root to keep, and the leases that protect one in use.

One rule, shared by ``ng-checkpoint gc ROOT --keep K`` and ``collect --keep K``:

- a **checkpoint** is a directory (or prefix) of ``ROOT`` holding ``gym/`` or ``collector/``;
  it is **published** once its publish marker exists: ``collector/manifest.json`` for a
  collection checkpoint (it has ``collector/``), else ``gym/participants.json``;
- checkpoints are ordered by the sequence number in their name when every one is named as
  ``collect`` names them (``collect-<seq>-<run>``), else by the time of their publish marker
  (an unpublished one: of its newest file), ties by name;
- the ``keep`` newest published ones are kept; older published ones are removed; an unpublished
  one older than the oldest kept is an abandoned write and is removed; a newer one is a write in
  progress and stays; with nothing published, nothing is removed;
- a checkpoint holding a **live lease** is never removed, whatever its age.

A caller that knows more narrows the rule (``collect`` does, for its own run):

- ``belongs``: only the checkpoints it accepts count at all (kept, removed); every other one is
  another run's and is never touched (``collect``: this collection's checkpoints only, by the output
  its collector manifest names, or by its run for an unpublished one);
- ``unpublished_failed``: no other write is under way (``collect`` holds the directory's lock), so an
  unpublished checkpoint is a failed attempt and is removed whatever its age (what a full disk left
  of it is free again before the next attempt writes);
- ``in_use``: checkpoints the caller is using now (the attempt it is about to write), never removed.

A lease is ``<checkpoint>/.ng-leases/<holder>.json``, created by the controller for the time a
commit into the checkpoint or a restore from it runs (``hold_lease``) and removed after:
``{"schema_version": 1, "operation", "checkpoint_id", "holder", "host", "pid", "expires_at"}``.
It is live until ``expires_at`` (the operation's deadline plus a margin), and while its process
lives when it names this host; a lease that cannot be read counts as live (a checkpoint is never
removed on a guess). Removal takes the publish marker first, so a removal cut short leaves an
unpublished checkpoint (removed by the next run), never a published one with files missing. The
records files a checkpoint that stays refers to (an incremental one) stay too (``retention_refs``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .._errors import InvalidCheckpointState
from .._process import pid_alive
from .layout import INDEX_NAME, MANIFEST_NAME, MAX_MANIFEST_BYTES
from .location import Location, child_dirs, lexists, location, names, read_small
from .objstore import ObjectPath
from .retention_refs import prune_to, referred_files

__all__ = ["LEASE_DIR", "Checkpoint", "Lease", "RetentionPlan", "hold_lease", "plan_retention", "remove_checkpoint"]

LEASE_DIR = ".ng-leases"
LEASE_MARGIN = 60.0
_COLLECT_NAME = re.compile(r"^collect-(?P<seq>[0-9]{6,})-[0-9a-f]{8}$")
_HOLDER = re.compile(r"^[0-9a-f]{32}\.json$")


@dataclass(frozen=True)
class Lease:
    operation: str
    checkpoint_id: str | None
    holder: str
    host: str | None
    pid: int | None
    expires_at: float | None
    problem: str | None = None

    def live(self, now: float) -> bool:
        if self.problem is not None:
            return True  # unreadable: never remove on a guess
        if self.expires_at is not None and self.expires_at <= now:
            return False
        if self.host == socket.gethostname() and self.pid is not None and not pid_alive(self.pid):
            return False
        return True

    def describe(self) -> str:
        if self.problem is not None:
            return f"a lease {self.holder} that cannot be read ({self.problem})"
        until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.expires_at or 0))
        return f"{self.operation} of {self.checkpoint_id} by pid {self.pid} on {self.host}, until {until}"


@dataclass
class Checkpoint:
    name: str
    path: Location
    published: bool
    order: tuple[Any, ...]
    leases: list[Lease] = field(default_factory=list)
    # Its records files that checkpoints which stay refer to (incremental ones): a removal keeps them.
    referred: set[str] = field(default_factory=set)


@dataclass
class RetentionPlan:
    """What ``keep`` means for a root now: ``remove`` is what the rule removes, newest first."""

    keep: int
    kept: list[Checkpoint] = field(default_factory=list)
    remove: list[Checkpoint] = field(default_factory=list)
    in_use: list[Checkpoint] = field(default_factory=list)
    in_progress: list[Checkpoint] = field(default_factory=list)


def _marker(path: Location) -> Location:
    return path / "collector" / MANIFEST_NAME if lexists(path / "collector") else path / "gym" / INDEX_NAME


def _modified(where: Location) -> float:
    """When ``where`` (a file or object) was last written; 0 when that cannot be told."""
    try:
        if isinstance(where, ObjectPath):
            stamp = where.fs.modified(where.native)
            return float(stamp.timestamp())
        return os.lstat(where).st_mtime
    except Exception:
        return 0.0


def _newest(where: Location) -> float:
    """The newest write of anything under ``where`` (an unpublished checkpoint's age)."""
    if isinstance(where, ObjectPath):
        try:
            found = where.fs.find(where.native, detail=True)
        except Exception:
            return 0.0
        # The listing's own times (S3: LastModified), not one request per object.
        return max((_stamp(info) for info in found.values()), default=0.0)
    newest = 0.0
    for directory, _dirs, files in os.walk(where):
        for name in files:
            with contextlib.suppress(OSError):
                newest = max(newest, os.lstat(os.path.join(directory, name)).st_mtime)
    return newest


def _stamp(info: dict[str, Any]) -> float:
    for key in ("LastModified", "mtime", "updated", "created"):
        value: Any = info.get(key)  # a datetime, a number or a string, as the filesystem reports it
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        if isinstance(value, int | float):
            return float(value)
    return 0.0


def read_leases(path: Location) -> list[Lease]:
    leases = []
    for name in names(path / LEASE_DIR):
        if not _HOLDER.fullmatch(name):
            continue
        holder = name[: -len(".json")]
        try:
            data = orjson.loads(read_small(path / LEASE_DIR / name, path / LEASE_DIR, name, MAX_MANIFEST_BYTES))
            leases.append(
                Lease(
                    str(data["operation"]),
                    data.get("checkpoint_id"),
                    holder,
                    data.get("host"),
                    data.get("pid"),
                    float(data["expires_at"]),
                )
            )
        except (InvalidCheckpointState, orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            leases.append(Lease("?", None, holder, None, None, None, problem=str(exc).splitlines()[0][:200]))
    return leases


def checkpoints(root: str | Path | Location, candidates: Callable[[str], bool] | None = None) -> list[Checkpoint]:
    """Every checkpoint of ``root`` (whose name ``candidates`` accepts), oldest first (the rule's order)."""
    base = location(root)
    found = []
    for name in child_dirs(base):
        if candidates is not None and not candidates(name):
            continue
        path = base / name
        inside = set(child_dirs(path))
        if not inside & {"gym", "collector", LEASE_DIR} and not _COLLECT_NAME.fullmatch(name):
            continue  # not a checkpoint: never touched
        marker = _marker(path)
        published = lexists(marker)
        found.append(Checkpoint(name, path, published, (), read_leases(path)))
    by_seq = all(_COLLECT_NAME.fullmatch(c.name) for c in found)
    for checkpoint in found:
        if by_seq:
            checkpoint.order = (int(_COLLECT_NAME.fullmatch(checkpoint.name)["seq"]), checkpoint.name)  # type: ignore[index]
        else:
            stamp = _modified(_marker(checkpoint.path)) if checkpoint.published else _newest(checkpoint.path)
            checkpoint.order = (stamp, checkpoint.name)
    return sorted(found, key=lambda c: c.order)


def plan_retention(
    root: str | Path | Location,
    keep: int,
    *,
    now: float | None = None,
    candidates: Callable[[str], bool] | None = None,
    belongs: Callable[[Checkpoint], bool] | None = None,
    unpublished_failed: bool = False,
    in_use: Collection[str] = (),
) -> RetentionPlan:
    """Apply the rule of the module docstring to ``root`` (only the checkpoints ``candidates`` accepts).

    ``in_use`` holds the paths (``str``) of checkpoints in use; ``belongs`` and ``unpublished_failed``
    narrow the rule as the module docstring says.
    """
    if keep < 1:
        raise ValueError("keep must be at least 1")
    now = time.time() if now is None else now
    everything = found = checkpoints(root, candidates)
    if belongs is not None:
        found = [c for c in found if belongs(c)]
    result = RetentionPlan(keep)
    published = [c for c in found if c.published]
    kept = published[-keep:]
    cutoff = kept[0].order if kept else None
    for checkpoint in reversed(found):
        if any(lease.live(now) for lease in checkpoint.leases) or str(checkpoint.path) in in_use:
            result.in_use.append(checkpoint)
        elif checkpoint in kept:
            result.kept.append(checkpoint)
        elif not checkpoint.published and unpublished_failed:
            result.remove.append(checkpoint)  # no write under way but those in use: a failed attempt
        elif not checkpoint.published and (cutoff is None or checkpoint.order > cutoff):
            result.in_progress.append(checkpoint)  # a write under way (or nothing published yet to prefer)
        else:
            result.remove.append(checkpoint)  # older than the oldest kept: superseded, or an abandoned write
    going = {id(c) for c in result.remove}
    referred = referred_files(c.path for c in everything if id(c) not in going)
    for checkpoint in result.remove:
        checkpoint.referred = referred.get(checkpoint.name, set())
    return result


def remove_checkpoint(checkpoint: Checkpoint, *, now: float | None = None) -> bool:
    """Remove one checkpoint the plan chose, unless a live lease appeared meanwhile; True when removed.

    The publish marker goes first: a removal cut short leaves an unpublished checkpoint.
    """
    if any(lease.live(time.time() if now is None else now) for lease in read_leases(checkpoint.path)):
        return False
    path = checkpoint.path
    for marker in (path / "collector" / MANIFEST_NAME, path / "gym" / INDEX_NAME):
        _remove(marker)
    if checkpoint.referred:
        prune_to(path, checkpoint.referred)  # what a staying checkpoint refers to stays (retention_refs)
        return True
    _remove(path, tree=True)
    return True


def _remove(where: Location, *, tree: bool = False) -> None:
    if isinstance(where, ObjectPath):
        from .objstore_put import remove

        remove(where, recursive=tree)
        return
    try:
        if tree:
            shutil.rmtree(where)
        else:
            os.unlink(where)
    except FileNotFoundError:
        return
    except OSError as exc:
        from .files import write_failed

        raise write_failed(exc, where, "cannot remove") from None


@contextlib.contextmanager
def hold_lease(
    checkpoint_dir: str | Path | Location, operation: str, checkpoint_id: str, deadline_ts: float
) -> Iterator[Lease]:
    """Hold a lease on ``checkpoint_dir`` while a commit into it or a restore from it runs.

    Expires at ``deadline_ts`` plus a margin, so a controller that dies leaves no lease that
    outlives its operation. On a filesystem path the lease goes only into a directory that exists:
    the controller never makes the checkpoint directory (the servers do, as the user they run as;
    a commit's new directory is the newest, which retention keeps anyway). A lease that cannot be
    written is not a failure of the operation; it is removed on exit.
    """
    where = location(checkpoint_dir)
    holder = uuid.uuid4().hex
    lease = Lease(operation, checkpoint_id, holder, socket.gethostname(), os.getpid(), deadline_ts + LEASE_MARGIN)
    path = where / LEASE_DIR / f"{holder}.json"
    body = orjson.dumps(
        {
            "schema_version": 1,
            "operation": operation,
            "checkpoint_id": checkpoint_id,
            "holder": holder,
            "host": lease.host,
            "pid": lease.pid,
            "expires_at": lease.expires_at,
        }
    )
    written = _write_lease(path, body)
    try:
        yield lease
    finally:
        if written:
            with contextlib.suppress(InvalidCheckpointState):
                _remove(path)
            if isinstance(path, Path):
                with contextlib.suppress(OSError):
                    os.rmdir(path.parent)  # only when empty: no lease directory left behind


def _write_lease(path: Location, body: bytes) -> bool:
    try:
        if isinstance(path, ObjectPath):
            path.fs.pipe_file(path.native, body)
            return True
        from .files import DIRECTORY_MODE, create_private

        if not path.parent.parent.is_dir():
            # Never made by the controller: the servers make the directory (as the user they run as).
            return False
        with contextlib.suppress(FileExistsError):
            path.parent.mkdir(mode=DIRECTORY_MODE)
        try:
            with create_private(path) as out:
                out.write(body)
        except BaseException:
            # Created but not written (a full disk): an unreadable lease counts as live for good, so it goes.
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        return True
    except Exception:
        return False
