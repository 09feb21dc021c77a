"""The files of Gym's training-token capture directory, as the model participant reads and rewrites them.

nemo-gym 0.7.0's ``TokenCaptureStore`` keeps, per capture key ``<key>`` (``r``, ``r-aN``):
``<key>.tokens.jsonl`` (one row per captured model call, each appended and fsynced under the
key's lock), ``.tokens.intents``, ``.tokens.incomplete``, ``.tokens.state.json`` (its index
and lifecycle flags) and ``.tokens.lock`` (the ``flock`` every writer of the key takes). With
external staging, ``FileLineageStore`` appends ledger rows to ``<key>.lineage.jsonl`` under
the same lock. The directory is run-wide: every model server of the run (policy, judge,
replicas) and Gym's consumer share it.

Two files are this plugin's own:

- ``<key>.ng-checkpoint-started``: created exclusively, under the key's lock, at the first
  model call of an attempt >= 1 that has capture files (a restored attempt), by whichever model
  server receives it. No server deletes a restored attempt as unscoped once it exists: another
  server may have written its rows.
- ``.ng-checkpoint-restore-<restore id>``: created, under the directory's own lock
  (``.ng-checkpoint.lock``), once what dead executions left for a restore's replacement attempts
  was cleared. Every other model server of the same restore then writes its rows without
  clearing again, which would delete rows a sibling already wrote. The server that created it
  removes it when the restore is resumed.

Locks are taken in one order only (the directory's, then a key's), and never twice in one thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
from nemo_gym_checkpoint_plugin.builtin_participants.shared.attempts import split_key
from nemo_gym_checkpoint_plugin.builtin_participants.shared.versions import stamp

__all__ = [
    "ATTEMPT_FILES",
    "LEDGER_ROWS",
    "STARTED",
    "TOKEN_ROWS",
    "CaptureDir",
    "Fingerprint",
    "capture_frozen",
    "reindex_capture",
]

TOKEN_ROWS = ".tokens.jsonl"
LEDGER_ROWS = ".lineage.jsonl"
TOKEN_STATE = ".tokens.state.json"
STARTED = ".ng-checkpoint-started"
_LOCK = ".tokens.lock"
# Every file of one attempt's capture but its lock (Gym keeps lock files, so that concurrent callers
# keep locking one inode).
ATTEMPT_FILES = (TOKEN_ROWS, ".tokens.intents", ".tokens.incomplete", TOKEN_STATE, LEDGER_ROWS, STARTED)
_DIRECTORY_LOCK = ".ng-checkpoint.lock"
# What a file's content is known by without reading it (``CaptureDir.fingerprint``).
Fingerprint = tuple[int, int, int, int, int]
_CLEARED = ".ng-checkpoint-restore-"


# The attempt file suffixes by their last dot-separated part (a key may hold dots itself: Gym allows ``._-``).
_BY_LAST_PART: dict[str, list[str]] = {}
for _suffix in ATTEMPT_FILES:
    _BY_LAST_PART.setdefault(_suffix.rpartition(".")[2], []).append(_suffix)


def _key_of(name: str) -> str | None:
    """The capture key of an attempt file's name, None for any other file."""
    for suffix in _BY_LAST_PART.get(name.rpartition(".")[2], ()):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return None


class CaptureDir:
    """One capture directory: its per-key locks, its listing, and the writes the model participant makes."""

    def __init__(self, root: str | Path) -> None:
        # A string, not a Path: the paths of thousands of keys are made per checkpoint and restore.
        self.root = os.fspath(root)

    def path(self, key: str, suffix: str) -> str:
        return f"{self.root}/{key}{suffix}"

    # -- locks -------------------------------------------------------------------------------------

    @contextmanager
    def locked(self, key: str, *, shared: bool = False) -> Iterator[None]:
        """Gym's own per-key lock (``TokenCaptureStore._locked``: the same file, the same ``flock``)."""
        with open(self.path(key, _LOCK), "a+b") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    @contextmanager
    def restore_locked(self) -> Iterator[None]:
        """The directory's lock: one model server at a time clears a restore's dead executions."""
        with open(self.path("", _DIRECTORY_LOCK), "a+b") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def cleared(self, restore_id: str) -> bool:
        return os.path.exists(self.path(_CLEARED, restore_id))

    def mark_cleared(self, restore_id: str) -> None:
        self._create(self.path(_CLEARED, restore_id), restore_id.encode())

    def forget_cleared(self, restore_id: str) -> None:
        """The restore ended (resumed): its marker goes, so a later restore reusing the id clears again."""
        with self.restore_locked():
            self.remove([f"{_CLEARED}{restore_id}"])

    # -- listing -----------------------------------------------------------------------------------

    def attempts(self, rollouts: Iterable[str], *, retried_only: bool = False) -> dict[str, dict[int, list[str]]]:
        """``{rollout: {attempt: [file names]}}`` of the attempt files of ``rollouts``, from one listing.

        ``retried_only``: attempts 1 and later only (their names hold ``-a``: most files of a directory,
        attempt 0's, are passed over without being parsed).
        """
        wanted = set(rollouts)
        found: dict[str, dict[int, list[str]]] = {}
        if not wanted:
            return found
        for name in os.listdir(self.root):
            if retried_only and "-a" not in name:
                continue
            key = _key_of(name)
            if key is None:
                continue
            rollout, attempt = split_key(key)
            if rollout in wanted:
                found.setdefault(rollout, {}).setdefault(attempt, []).append(name)
        return found

    def remove(self, names: Iterable[str]) -> int:
        """Unlink ``names`` (gone already is fine); the count removed. The caller syncs the directory."""
        removed = 0
        for name in names:
            try:
                os.unlink(f"{self.root}/{name}")
                removed += 1
            except FileNotFoundError:
                pass
        return removed

    def remove_attempt(self, key: str) -> None:
        self.remove(f"{key}{suffix}" for suffix in ATTEMPT_FILES)

    def fsync(self) -> None:
        descriptor = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)

    # -- rows --------------------------------------------------------------------------------------

    def read_rows(self, key: str, suffix: str) -> list[tuple[bytes, dict[str, Any]]]:
        """``(line, row)`` of every JSON row of ``<key><suffix>`` (none when absent); a torn last line is skipped."""
        try:
            with open(self.path(key, suffix), "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            return []
        return rows_of(data)

    def read_lines(self, key: str, suffix: str) -> tuple[list[bytes], Fingerprint | None]:
        """The complete lines of ``<key><suffix>`` (none when absent), newlines cut, and the file's fingerprint.

        Gym ends every row it appends with a newline: a last line without one is a write in progress or torn,
        not a line. The fingerprint is the file's as read (None when absent): when it changed while it was
        read (a row appended meanwhile), one that no fingerprint equals (``fingerprint``).
        """
        try:
            handle = open(self.path(key, suffix), "rb")
        except FileNotFoundError:
            return [], None
        with handle:
            before = os.fstat(handle.fileno())
            data = handle.read()
            after = os.fstat(handle.fileno())
        found = _fingerprint(before)
        if found != _fingerprint(after) or len(data) != before.st_size:
            found = _changing()
        lines = data.split(b"\n")
        lines.pop()  # what follows the last newline: nothing, or an unfinished line
        return [line for line in lines if line.strip()], found

    def fingerprint(self, key: str, suffix: str) -> Fingerprint | None:
        """``(device, inode, size, mtime, ctime)`` of ``<key><suffix>`` now (nanoseconds), None when absent.

        Equal fingerprints mean the same content: Gym appends rows (size and mtime change), cuts a torn
        tail (size), and this plugin replaces a file with a new one (inode) or appends. Opened, then
        ``fstat``: on NFS an open revalidates the file's attributes (close-to-open), a bare ``stat``
        may answer from the client's cache. A file rewritten in place to the same size within one
        timestamp tick would look unchanged: no writer of the directory does that.
        """
        try:
            descriptor = os.open(self.path(key, suffix), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            return _fingerprint(os.fstat(descriptor))
        finally:
            os.close(descriptor)

    def append(self, key: str, suffix: str, rows: list[tuple[str, bytes]]) -> None:
        """Append ``rows`` (``(model call id, line)``) to ``<key><suffix>`` in one write, creating it; no sync.

        A file that already has content (a sibling server's rows, or an install retried after a
        crash) is read first: a row whose model call id is there already is not written again,
        and a torn last line is cut. The caller syncs the directory.
        """
        if not rows:
            return
        path = self.path(key, suffix)
        try:
            # The usual case: the replacement attempt has no file yet.
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o666)
        except FileExistsError:
            descriptor = os.open(path, os.O_WRONLY | os.O_APPEND)
            try:
                with open(path, "rb") as handle:
                    data = handle.read()
                if not data.endswith(b"\n"):
                    os.ftruncate(descriptor, data.rfind(b"\n") + 1)
                present = {row.get("model_call_id") for _line, row in rows_of(data)}
                rows = [(call_id, line) for call_id, line in rows if call_id not in present]
            except BaseException:
                os.close(descriptor)
                raise
        try:
            _write_all(descriptor, b"".join(line for _call_id, line in rows))
        finally:
            os.close(descriptor)

    def replace(self, key: str, suffix: str, lines: list[bytes]) -> None:
        """Replace ``<key><suffix>`` with ``lines`` atomically (a new inode: Gym's readers see the change)."""
        path = self.path(key, suffix)
        with tempfile.NamedTemporaryFile(dir=self.root, prefix=".ng-checkpoint-rows-", delete=False) as handle:
            temporary = Path(handle.name)
            try:
                handle.write(b"".join(lines))
                handle.flush()
                os.fsync(handle.fileno())
                with contextlib.suppress(FileNotFoundError):  # the rows keep the mode Gym created them with
                    os.chmod(handle.fileno(), stat.S_IMODE(os.stat(path).st_mode))
            except BaseException:
                temporary.unlink(missing_ok=True)
                raise
        try:
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
        self.fsync()

    # -- the started marker ------------------------------------------------------------------------

    def mark_started(self, key: str) -> bool:
        """Under the key's lock: when ``key`` has capture rows, create its started marker. True when it exists now."""
        with self.locked(key):
            if not (os.path.exists(self.path(key, TOKEN_ROWS)) or os.path.exists(self.path(key, LEDGER_ROWS))):
                return False
            try:
                self._create(self.path(key, STARTED), b"")
            except FileExistsError:
                pass
            return True

    def started(self, key: str) -> bool:
        return os.path.exists(self.path(key, STARTED))

    def _create(self, path: str, content: bytes) -> None:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            _write_all(descriptor, content)
        finally:
            os.close(descriptor)


def rows_of(data: bytes) -> list[tuple[bytes, dict[str, Any]]]:
    """``(line, row)`` of every line of ``data`` holding a JSON object (line with its newline).

    A last line that does not parse and ends no line is the torn tail of a write that never
    completed: skipped, as Gym's store drops it. Any other line that does not parse raises.
    """
    found = []
    lines = data.split(b"\n")
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            if index == len(lines) - 1:
                break
            raise
        if isinstance(row, dict):
            found.append((line + b"\n", row))
    return found


def _fingerprint(status: os.stat_result) -> Fingerprint:
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)


def _changing() -> Fingerprint:
    """A fingerprint no other equals: for a file that changed while it was read (its content is no one state)."""
    return (-1, -1, -1, -1, stamp())


def _write_all(descriptor: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(descriptor, view)
        view = view[written:]


def capture_frozen(store: Any, key: str) -> bool:
    """Whether Gym's consumer froze (or retired) ``key``'s capture: its rows are the trainer's now."""
    state = store.state_path_for(key)
    try:
        value = orjson.loads(state.read_bytes())
    except FileNotFoundError:
        return False
    except orjson.JSONDecodeError:
        return True  # unreadable: never delete what might be the trainer's
    return isinstance(value, dict) and bool(value.get("frozen") or value.get("retired"))


def reindex_capture(store: Any, key: str) -> None:
    """After rows were dropped from ``key``'s file: Gym's state re-reads its index from the file (flags kept).

    The caller holds the key's lock. Gym rebuilds ``entry_digests`` from offset 0 on its next use.
    """
    if not store.state_path_for(key).exists():
        return
    state = store._read_state(key)  # Gym's own reader and writer of its state file (0.7.x)
    state["entry_digests"] = {}
    state["indexed_size"] = 0
    state["version"] = int(state.get("version", 0)) + 1
    store._write_state(key, state)
