"""The model participant's records as ``api.Versioned`` ones: an unchanged episode is referred to, never read again.

A model record (``calls.py``) holds an episode attempt's captured rows that this server owns
(``token_capture.py``: token rows, and ledger rows with external staging) and its generation cut
(``cut_book.py``). Its version changes whenever what the record would hold can have changed:

- **the calls it owns**: the ``CaptureBook``'s stamp of the attempt, new at every call delivered and
  at the restore that installed its rows (a retire or a scope forgets the attempt, and its stamp);
- **its capture files**: their fingerprints (``CaptureDir.fingerprint``: device, inode, size,
  mtime, ctime), so rows removed or rewritten by another model server sharing the directory (a call
  sent again after a restore drops the restored rows it answers again), by Gym's consumer (a
  dropped capture) or by this server change the version, though no event of this process says so.
  A row another server appended (not this server's: never in the record) changes it too: that
  record is written again, the same;
- **its cut**: the cut's own source (a restored cut) or, for a generation streaming here, the
  generation, its lists and the snapshot's lengths and fields (``CutBook.version``).

Unchanged records cost one ``open`` and ``fstat`` per row file (two with external staging): the
files are not read. The export runs in the storage writer's thread (the records are an iterator):
per episode whose owned calls and cut are those this participant exported last time, the files'
fingerprints are taken; when the version is the same, the record is yielded unbuilt (the writer
refers to the previous checkpoint's line, or builds it when it cannot). Otherwise the rows are
read now, and the version is made of the fingerprints of the very bytes read (a file that changed
while it was read gets a version nothing equals). What was found at each version is kept (whether
it made a record, the staged keys it refers to), so a version that made no record (no owned row
left in the files) makes none again without a read, and the commit reply's ``staging_keys`` name a
referred record's keys.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from nemo_gym_checkpoint_plugin.builtin_participants.model.cut_book import CUT_FIELD, CutBook
from nemo_gym_checkpoint_plugin.builtin_participants.model.token_capture import StagingKeys, TokenCaptures

from nemo_gym_checkpoint_plugin._identity import episode_to_wire, from_capture_key
from nemo_gym_checkpoint_plugin._types import Versioned

__all__ = ["ModelRecords"]


@dataclass(frozen=True)
class _Seen:
    """What an export found at one version of an episode's record."""

    episode: Mapping[str, Any]  # its episode_id (shared by its records: never changed)
    version: Any
    record: bool  # whether it made a record
    staged: tuple[str, ...]  # the staged keys its ledger rows refer to (external staging)


class ModelRecords:
    """Versioned records of one model server's exports (see the module docstring)."""

    def __init__(self, captures: TokenCaptures | None) -> None:
        self.captures = captures
        self._seen: dict[str, _Seen] = {}  # by capture key: the last export's (replaced at its end)

    def export(
        self,
        owned: Mapping[str, tuple[int, set[str]]],
        cuts: Mapping[str, tuple[Any, Any]],
        staging: StagingKeys | None,
    ) -> Iterator[Versioned]:
        """The ``Versioned`` record of each episode in ``owned`` (``{key: (stamp, call ids)}``, this server's
        calls) or ``cuts`` (``{key: (cut source, its version)}``), sorted by key; runs in the writer's thread."""
        seen = self._seen
        found: dict[str, _Seen] = {}
        captures = self.captures
        for key in sorted(owned.keys() | cuts.keys()):
            before = seen.get(key)
            if before is not None:
                episode = before.episode
            else:
                try:
                    episode = episode_to_wire(from_capture_key(key))
                except ValueError:
                    continue  # not an episode attempt's key
            stamp, ids = owned.get(key, (None, None))
            source, cut_version = cuts.get(key, (None, None))
            # Fingerprints (no read) only when nothing else changed: else the rows are read below anyway.
            if before is not None and before.version[0] == stamp and before.version[2] == cut_version:
                files = captures.fingerprints(key) if captures is not None and ids else None
                version = (stamp, files, cut_version)
                if before.version == version:
                    found[key] = before
                    if not before.record:
                        continue
                    if staging is not None and before.staged:
                        staging.by_episode[key] = list(before.staged)
                    # Built only when the writer cannot refer to the previous checkpoint's line (then read now).
                    yield Versioned(episode, version, partial(self._record, key, episode, ids, source, staging))
                    continue
            record, files = self._build(key, episode, ids, source, staging)
            version = (stamp, files, cut_version)  # the fingerprints of what was read
            staged = tuple(staging.by_episode.get(key, ())) if staging is not None else ()
            found[key] = _Seen(episode, version, record is not None, staged)
            if record is not None:
                yield Versioned(episode, version, record)
        self._seen = found
        if staging is not None:
            staging.finish()

    def _record(
        self, key: str, episode: Mapping[str, Any], ids: set[str] | None, source: Any, staging: StagingKeys | None
    ) -> dict[str, Any]:
        """The record of an unchanged version, built: what the files hold now (no owned row left: none, said so)."""
        record, _files = self._build(key, episode, ids, source, staging)
        if record is not None:
            return record
        return {"episode_id": episode, "token_rows": []} if ids else {"episode_id": episode}

    def _build(
        self, key: str, episode: Mapping[str, Any], ids: set[str] | None, source: Any, staging: StagingKeys | None
    ) -> tuple[dict[str, Any] | None, Any]:
        """The record of ``key`` (None when it holds nothing) and the fingerprints of the files it was read from."""
        record: dict[str, Any] | None = None
        files = None
        if self.captures is not None and ids:
            if staging is not None:
                staging.by_episode.pop(key, None)  # filled again from the rows read
            rows = self.captures.owned_rows(key, ids)
            files = rows.files
            record = self.captures.record(key, episode, rows, staging)
        cut = CutBook.record(source) if source is not None else None
        if cut is not None:
            record = {"episode_id": episode} if record is None else record
            record[CUT_FIELD] = cut
        return record, files
