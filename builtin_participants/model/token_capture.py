"""Gym's training-token capture across a checkpoint: the model participant's records (docs/protocol.md section 9).

With nemo-gym 0.7.0's ``token_id_capture`` block on and its file store in use, the trainer
reads Gym's capture rows, not this plugin's checkpoint: ``<key>.tokens.jsonl`` per episode
attempt (what ``trajectories_for_rollout`` rebuilds a rollout from) and, with external staging
(a worker staging tokens through Gym's ``CaptureAdmission``), ``<key>.lineage.jsonl`` ledger
rows. A restored rollout runs as attempt N+1 and records its new calls under ``r-a<N+1>``. So,
for every episode a checkpoint continues, the rows under ``r-a<N+1>`` must hold exactly the calls
whose complete answer reached the agent before its exported boundary, each once, whichever of
the model servers sharing the directory wrote them (``capture_files.py`` has the files):

- **export**: a model server exports only rows of calls it *owns*: calls whose answer started
  reaching their caller from this process, and rows it installed. A call held, generating or
  parked is owned by no one, so nobody exports it; a sibling server never exports another's rows.
  One record per episode: ``{"episode_id", "token_rows": [[id, line], ...]}`` plus ``"ledger_rows"``
  with external staging, each row its line on disk as JSON text (never parsed or encoded again),
  exported as an ``api.Versioned`` record whose version names the owned calls and the files'
  fingerprints (``model_records.py``): an unchanged episode's files are not read again;
- **install**: the rows go under the replacement attempt's key, each keeping the capture key it
  was first recorded under (a token row's own ``rollout_id``; a ledger row's
  ``ng_checkpoint_restored_from``). First, once per restore for all servers sharing the
  directory, what dead executions left for attempt N+1 and later is removed; attempts up to N
  are removed once the install succeeded (in the background: nothing reads them again). On a
  server with several workers the worker that receives a replacement's first call installs its
  rows then (its claim): the dead executions of that one replacement are cleared first, and its
  attempts up to N removed after;
- **a call sent again** (``supersede``): an answer that started reaching the agent is exported,
  since its row is complete before its first byte (Gym captures before it responds). If it did
  not reach the agent before its boundary, the continued turn sends the same request again; at
  that call's response start, before its answer reaches the agent, the server that answered it
  removes the restored rows with the same request context (Gym's ``continuation_context_digest``
  / the ledger's ``context_digest``) that no later row builds on, and their restored
  descendants. So a started stream never blocks readiness, and nothing is spliced;
- **delete** (an unscoped restored attempt): only when no model server started it (its started
  marker) and Gym's consumer has not frozen it; the caller drops its bookkeeping only after.

Rows are checked for their shape at install (a model call id, Gym's key rules, token arrays of
matching lengths); their content is the records file's, whose digest the restore verified.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from nemo_gym_checkpoint_plugin.builtin_participants.model.capture_files import (
    LEDGER_ROWS,
    TOKEN_ROWS,
    CaptureDir,
    Fingerprint,
    capture_frozen,
    reindex_capture,
)
from nemo_gym_checkpoint_plugin.builtin_participants.model.capture_rows import (
    LEDGER,
    RESTORED_FROM,
    TOKENS,
    ledger_line,
    ledger_row_id,
    row_id_of,
    token_row_id,
    unpack_line,
)
from nemo_gym_checkpoint_plugin.builtin_participants.shared.attempts import split_key

from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState
from nemo_gym_checkpoint_plugin._identity import EpisodeId, episode_to_wire, from_capture_key
from nemo_gym_checkpoint_plugin._types import rollout_attempts

__all__ = ["OwnedRows", "StagedRows", "StagingKeys", "TokenCaptures", "token_captures_for"]

logger = logging.getLogger(__name__)


def token_captures_for(server: Any) -> TokenCaptures | None:
    """The capture store of a model server's config, when token capture writes Gym's file store; else None.

    A custom ``sink`` (or, with external staging, a custom ``lineage_store``) keeps its rows where this
    plugin cannot carry them: said once, as a warning, when the server starts.
    """
    global_config = getattr(getattr(server, "server_client", None), "global_config_dict", None)
    if global_config is None:
        return None
    from nemo_gym.token_id_capture.config import TokenIdCaptureConfig
    from nemo_gym.token_id_capture.store import make_token_store

    settings = TokenIdCaptureConfig.model_validate(global_config).token_id_capture
    custom_ledger = settings.external_staging and settings.lineage_store
    custom = "sink" if settings.sink else "lineage_store" if custom_ledger else None
    if settings.enabled and custom is not None:
        logger.warning(
            "token_id_capture.%s is a custom store: checkpoints do not carry its rows, so after a restore a "
            "continued rollout's capture lacks the calls made before the crash (Gym's rebuild masks it)",
            custom,
        )
    store = make_token_store(global_config)
    if store is None:
        return None
    return TokenCaptures(store, ledger=settings.external_staging and not settings.lineage_store)


@dataclass
class StagingKeys:
    """The staged keys an export refers to (external staging): filled while its records are written."""

    keys: list[str] = field(default_factory=list)
    by_episode: dict[str, list[str]] = field(default_factory=dict)

    def add(self, key: str, rows: Iterable[Mapping[str, Any]]) -> None:
        staged: set[str] = set()
        for row in rows:
            if isinstance(row.get("staging_key"), str):
                staged.add(row["staging_key"])
            staged.update(k for k in row.get("staging_chain") or () if isinstance(k, str))
        if staged:
            self.by_episode[key] = sorted(staged)

    def finish(self) -> None:
        # Sorted in place: the commit reply holds these very lists.
        self.keys[:] = sorted({k for keys in self.by_episode.values() for k in keys})


@dataclass
class OwnedRows:
    """The rows of one episode attempt a model server owns, and the fingerprints of the files they were read from."""

    tokens: list[tuple[str, bytes]]
    ledger: list[tuple[str, bytes]]
    files: tuple[Fingerprint | None, ...]


@dataclass
class StagedRows:
    """One restored record, checked: the replacement attempt's key and the lines to write under it."""

    key: str
    tokens: list[tuple[str, bytes]]
    ledger: list[tuple[str, bytes]]

    @property
    def call_ids(self) -> set[str]:
        return {call_id for call_id, _line in self.tokens} | {call_id for call_id, _line in self.ledger}


class TokenCaptures:
    """Export, install, supersede and delete the captured rows of episode attempts in one capture directory."""

    def __init__(self, store: Any, *, ledger: bool = False) -> None:
        self.store = store
        self.files = CaptureDir(store.root)
        self.ledger = ledger

    # -- export ------------------------------------------------------------------------------------

    def export(
        self, keys: Iterable[str], owned: Mapping[str, set[str]], staging: StagingKeys | None = None
    ) -> Iterator[dict[str, Any]]:
        """One record per key with rows whose model call id ``owned[key]`` names (``record``), as plain records.

        Lazy: one episode's rows in memory at a time. The model participant exports them as
        ``Versioned`` records instead (``model_records.py``), from the same ``owned_rows`` and ``record``.
        """
        for key in keys:
            ids = owned.get(key)
            if not ids:
                continue
            try:
                episode = episode_to_wire(from_capture_key(key))
            except ValueError:
                continue  # not an episode attempt's key
            record = self.record(key, episode, self.owned_rows(key, ids), staging)
            if record is not None:
                yield record
        if staging is not None:
            staging.finish()

    def fingerprints(self, key: str) -> tuple[Fingerprint | None, ...]:
        """The fingerprints of ``key``'s row files now (``CaptureDir.fingerprint``): equal, the same rows."""
        tokens = self.files.fingerprint(key, TOKEN_ROWS)
        return (tokens, self.files.fingerprint(key, LEDGER_ROWS)) if self.ledger else (tokens,)

    def owned_rows(self, key: str, ids: set[str]) -> OwnedRows:
        """The rows of ``key`` that ``ids`` name, in file order, and the fingerprints of the files as read."""
        # No lock: an owned row was complete before its answer started, and a row Gym appends now (a call
        # finishing generation while admission is closed) is owned by no one; an unfinished last line is skipped.
        tokens, token_file = self._owned_lines(key, TOKEN_ROWS, ids)
        if not self.ledger:
            return OwnedRows(tokens, [], (token_file,))
        ledger, ledger_file = self._owned_lines(key, LEDGER_ROWS, ids)
        return OwnedRows(tokens, ledger, (token_file, ledger_file))

    @staticmethod
    def record(
        key: str, episode: Mapping[str, Any], rows: OwnedRows, staging: StagingKeys | None
    ) -> dict[str, Any] | None:
        """The record of ``rows``: ``{"episode_id", "token_rows"}`` (and ``"ledger_rows"``); None without rows.

        A row goes into the record as it is on disk, ``[model call id, its line]`` (the line as JSON
        text): never parsed or encoded again (a row holds its prompt's and generation's token ids).
        """
        if not rows.tokens and not rows.ledger:
            return None
        record: dict[str, Any] = {
            "episode_id": episode,
            "token_rows": [[call_id, line.decode()] for call_id, line in rows.tokens],
        }
        if rows.ledger:
            record["ledger_rows"] = [[call_id, line.decode()] for call_id, line in rows.ledger]
            if staging is not None:
                staging.add(key, [orjson.loads(line) for _call_id, line in rows.ledger])
        return record

    def _owned_lines(self, key: str, suffix: str, ids: set[str]) -> tuple[list[tuple[str, bytes]], Fingerprint | None]:
        """``(model call id, line without its newline)`` of the owned rows of ``<key><suffix>``, in file order; the
        file's fingerprint as read."""
        found = []
        lines, fingerprint = self.files.read_lines(key, suffix)
        for line in lines:
            call_id = row_id_of(line)
            if call_id is None or call_id not in ids:
                # Not the usual shape (the id not where Gym writes it): the line itself says.
                row = orjson.loads(line)
                call_id = row.get("model_call_id") if isinstance(row, dict) else None
            if call_id in ids:
                found.append((call_id, line))
        return found, fingerprint

    # -- install -----------------------------------------------------------------------------------

    def stage(self, checkpointed: str, replacement: str, record: Mapping[str, Any]) -> StagedRows:
        """The lines to write under ``replacement`` for a restored record; ``InvalidCheckpointState`` for a bad one.

        Records hold rows as ``[id, line]`` (``token_rows``, ``ledger_rows``); those of earlier
        releases held them as JSON objects (``token_entries``, ``ledger_entries``), and still restore.
        """
        rows = record.get("token_rows")
        token_lines: list[tuple[str, bytes]]
        ledger_lines: list[tuple[str, bytes]]
        if type(rows) is list and len(record) == 2:
            # This release's record of the local store, the usual one: {"episode_id", "token_rows"}.
            token_lines, ledger_lines = [unpack_line(checkpointed, row) for row in rows], []
        else:
            token_lines, ledger_lines = self._stage_any(checkpointed, record)
        for family in (token_lines, ledger_lines):
            if len(family) > 1:
                ids = [call_id for call_id, _line in family]
                if len(set(ids)) != len(ids):
                    twice = sorted({i for i in ids if ids.count(i) > 1})[0]
                    raise InvalidCheckpointState(
                        f"episode {checkpointed}: model call {twice} twice", episode=checkpointed
                    )
        return StagedRows(key=replacement, tokens=token_lines, ledger=ledger_lines)

    def _stage_any(
        self, checkpointed: str, record: Mapping[str, Any]
    ) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes]]]:
        """Every other record: ledger rows (external staging), or an earlier release's rows as JSON objects."""
        tokens = _list(checkpointed, record, "token_rows") + _list(checkpointed, record, "token_entries")
        ledger = _list(checkpointed, record, "ledger_rows") + _list(checkpointed, record, "ledger_entries")
        if ledger and not self.ledger:
            raise InvalidCheckpointState(
                f"episode {checkpointed}: the checkpoint holds ledger rows of external staging, which is off here",
                episode=checkpointed,
            )
        token_lines = [
            unpack_line(checkpointed, row) if isinstance(row, list) else _token_line(checkpointed, row)
            for row in tokens
        ]
        ledger_rows = [
            orjson.loads(unpack_line(checkpointed, row)[1]) if isinstance(row, list) else row for row in ledger
        ]
        ledger_lines = [
            (ledger_row_id(checkpointed, row), ledger_line({RESTORED_FROM: checkpointed, **row})) for row in ledger_rows
        ]
        return token_lines, ledger_lines

    def install(
        self, restore_id: str, scope: Sequence[EpisodeId], staged: Sequence[StagedRows], *, claimed: bool = False
    ) -> bool:
        """Clear what dead executions left for the scope (once per restore), write ``staged``, sync once.

        True when this call did the clearing (the first model server of the restore to get here).
        A raising install removes the attempts it wrote to (their rows are of no use: the restore fails).

        ``claimed``: a worker's claim of the replacements in ``scope`` (several workers), at the first
        call of each, after the restore resumed: their dead executions are cleared now whatever other
        claims did (no restore marker), and once the rows are written the attempts before them go (their
        rows live on under the replacement), since no restore's end comes after a claim to remove them.
        """
        cleared = False
        with self.files.restore_locked():
            if claimed:
                self._clear_dead_executions(scope)
            elif not self.files.cleared(restore_id):
                self._clear_dead_executions(scope)
                self.files.mark_cleared(restore_id)
                cleared = True
        written: list[str] = []
        try:
            for rows in staged:
                written.append(rows.key)
                self.files.append(rows.key, TOKEN_ROWS, rows.tokens)
                self.files.append(rows.key, LEDGER_ROWS, rows.ledger)
            self.files.fsync()
        except BaseException:
            for key in written:
                self.files.remove_attempt(key)
            raise
        if claimed:
            self.remove_continued(scope)
        return cleared

    def _clear_dead_executions(self, scope: Sequence[EpisodeId]) -> None:
        # The scope's pairs: a restore's scope names every episode (16,000), EpisodeIds made only if read.
        first = dict(rollout_attempts(scope))
        # A replacement is attempt 1 or later: so is every file of a dead execution it must not meet.
        found = self.files.attempts(first, retried_only=True)
        dead = [
            name
            for rollout, attempts in found.items()
            for attempt, names in attempts.items()
            if attempt >= first[rollout]
            for name in names
        ]
        if dead:
            self.files.remove(dead)
            self.files.fsync()

    def remove_continued(self, scope: Sequence[EpisodeId]) -> None:
        """Remove the attempts before each replacement in ``scope``: the rows live on under the replacement."""
        first = dict(rollout_attempts(scope))
        found = self.files.attempts(first)
        old = [
            name
            for rollout, attempts in found.items()
            for attempt, names in attempts.items()
            if attempt < first[rollout]
            for name in names
        ]
        if old:
            self.files.remove(old)
            self.files.fsync()

    # -- the restored attempt's life ---------------------------------------------------------------

    def mark_started(self, key: str) -> bool:
        """A call of attempt ``key`` (>= 1) arrived: mark it started when it has rows (a restored attempt)."""
        return self.files.mark_started(key)

    def delete(self, keys: Iterable[str]) -> None:
        """Delete the restored attempts ``keys`` unless a model server started one or Gym's consumer froze it.

        A started attempt's files may hold rows another server wrote since; a frozen one's are the
        trainer's. Those are kept. Raising leaves the caller's bookkeeping for a retry (deleting twice is fine).
        """
        for key in keys:
            with self.files.locked(key):
                if not self.files.started(key) and not capture_frozen(self.store, key):
                    self.files.remove_attempt(key)
        self.files.fsync()

    def supersede(self, key: str, call_id: str | None) -> bool:
        """Call ``call_id`` of attempt ``key`` was answered: drop the restored rows it answers again.

        Returns True when no restored row of ``key`` is left that a later call could answer again
        (every one has a later row building on it, or was dropped): the key is settled.
        """
        if split_key(key)[1] == 0:
            return True  # attempt 0 is never restored
        settled = True
        with self.files.locked(key):
            families = [(TOKEN_ROWS, TOKENS)] + ([(LEDGER_ROWS, LEDGER)] if self.ledger else [])
            for suffix, family in families:
                rows = self.files.read_rows(key, suffix)
                victims, unconfirmed = family.superseded(key, call_id, [row for _line, row in rows])
                if victims:
                    kept = [line for line, row in rows if row.get("model_call_id") not in victims]
                    self.files.replace(key, suffix, kept)
                    if suffix == TOKEN_ROWS:
                        reindex_capture(self.store, key)
                settled = settled and not unconfirmed
        return settled


def _list(key: str, record: Mapping[str, Any], field: str) -> list[Any]:
    value = record.get(field, [])
    if not isinstance(value, list):
        raise InvalidCheckpointState(f"episode {key}: {field} must be a list", episode=key)
    return value


def _token_line(key: str, row: Any) -> tuple[str, bytes]:
    """A token row of an earlier release's record (a JSON object): checked, encoded as Gym writes it."""
    return token_row_id(key, row), orjson.dumps(row, option=orjson.OPT_SORT_KEYS) + b"\n"
