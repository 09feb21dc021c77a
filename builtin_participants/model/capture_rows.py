"""The two kinds of Gym capture row a model server carries, as the model participant reads them.

A token row (``<key>.tokens.jsonl``, Gym's ``TokenEntry``) and a ledger row (``<key>.lineage.jsonl``,
``FileLineageStore``, external staging) each say which call they record (``model_call_id``), which
call they continue (``parent_call_id``) and which request produced them (a token row's
``continuation_context_len``/``_digest``, a ledger row's ``context_len``/``context_digest``: Gym's
``conversation_digest`` of the request). Rows a restore installed say so: a token row keeps the
capture key it was first recorded under in its ``rollout_id`` (not the attempt's key), a ledger row
names it in ``ng_checkpoint_restored_from``.

``superseded`` is the rule for a call sent again after a restore (``token_capture.py``): the
restored rows with the new call's request that no live row builds on are the answers that never
reached the agent. The shape checks here are what Gym's readers need of a row to accept it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState

__all__ = [
    "LEDGER",
    "RESTORED_FROM",
    "TOKENS",
    "ledger_line",
    "ledger_row_id",
    "row_id_of",
    "token_row_id",
    "unpack_line",
]

# A ledger row installed by a restore names the capture key it was first recorded under (ledger rows
# carry no rollout id of their own; a token row's rollout_id says the same).
RESTORED_FROM = "ng_checkpoint_restored_from"
# Gym's TokenEntry schema versions this plugin knows (0.7.0 writes 1).
_SCHEMA_VERSIONS = (1,)


class _Family:
    """How one kind of capture row says which rows a restore installed, their parents and their request."""

    def __init__(self, context_len: str, context_digest: str) -> None:
        self._len, self._digest = context_len, context_digest

    def restored(self, key: str, row: Mapping[str, Any]) -> bool:
        raise NotImplementedError

    def context(self, row: Mapping[str, Any]) -> tuple[Any, Any] | None:
        digest = row.get(self._digest)
        return (row.get(self._len), digest) if isinstance(digest, str) and digest else None

    def superseded(self, key: str, call_id: str | None, rows: list[dict[str, Any]]) -> tuple[set[str], bool]:
        """``(model call ids to drop, whether restored rows are left unconfirmed)``."""
        # Keyed by each row's own model_call_id, whatever it holds (a row's shape is checked where it is read).
        restored: dict[Any, dict[str, Any]] = {row.get("model_call_id"): row for row in rows if self.restored(key, row)}
        if not restored:
            return set(), False
        live = [row for row in rows if not self.restored(key, row)]
        confirmed: set[Any] = set()
        for row in live:  # a restored row a live row builds on reached the agent
            parent = row.get("parent_call_id")
            while parent in restored and parent not in confirmed:
                confirmed.add(parent)
                parent = restored[parent].get("parent_call_id")
        answered = next((row for row in live if row.get("model_call_id") == call_id), None)
        context = self.context(answered) if answered is not None else None
        victims = {
            row_id
            for row_id, row in restored.items()
            if context is not None and row_id not in confirmed and self.context(row) == context
        }
        if victims:
            victims |= _descendants(restored, victims)
        return victims, bool(set(restored) - confirmed - victims)


class _TokenRows(_Family):
    def restored(self, key: str, row: Mapping[str, Any]) -> bool:
        return row.get("rollout_id") != key


class _LedgerRows(_Family):
    def restored(self, key: str, row: Mapping[str, Any]) -> bool:
        return row.get(RESTORED_FROM) is not None


TOKENS = _TokenRows("continuation_context_len", "continuation_context_digest")
LEDGER = _LedgerRows("context_len", "context_digest")


def _descendants(rows: Mapping[Any, Mapping[str, Any]], roots: set[Any]) -> set[Any]:
    found: set[Any] = set()
    for row_id, row in rows.items():
        seen: set[Any] = set()
        parent = row.get("parent_call_id")
        while parent in rows and parent not in seen:
            if parent in roots:
                found.add(row_id)
                break
            seen.add(parent)
            parent = rows[parent].get("parent_call_id")
    return found


def _refuse(key: str, what: str) -> InvalidCheckpointState:
    return InvalidCheckpointState(f"episode {key}: {what}", episode=key)


def token_row_id(key: str, row: Any) -> str:
    """The model call id of a token row after its shape checks (what Gym's ``TokenEntry`` requires of it)."""
    if not isinstance(row, dict):
        raise _refuse(key, "a token entry is not an object")
    call_id, rollout_id = row.get("model_call_id"), row.get("rollout_id")
    if not isinstance(call_id, str) or not call_id:
        raise _refuse(key, "a token entry has no model_call_id")
    if not isinstance(rollout_id, str) or not _gym_key(rollout_id):
        raise _refuse(key, f"token entry {call_id}: rollout_id {rollout_id!r} is not a capture key")
    if row.get("schema_version", 1) not in _SCHEMA_VERSIONS:
        raise _refuse(key, f"token entry {call_id}: schema_version {row.get('schema_version')!r} is not known here")
    prompt, generated, logprobs = (
        row.get(name) for name in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
    )
    if not (isinstance(prompt, list) and isinstance(generated, list) and isinstance(logprobs, list)) or len(
        generated
    ) != len(logprobs):
        raise _refuse(key, f"token entry {call_id}: token arrays are missing or of different lengths")
    return call_id


def ledger_row_id(key: str, row: Any) -> str:
    if not isinstance(row, dict):
        raise _refuse(key, "a ledger entry is not an object")
    call_id = row.get("model_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise _refuse(key, "a ledger entry has no model_call_id")
    restored_from = row.get(RESTORED_FROM)
    if restored_from is not None and not (isinstance(restored_from, str) and _gym_key(restored_from)):
        raise _refuse(key, f"ledger entry {call_id}: {RESTORED_FROM} is not a capture key")
    return call_id


_ID_KEY = b'"model_call_id":"'


def row_id_of(line: bytes) -> str | None:
    """The model call id of a row's JSON line, found without parsing the line (a row may hold megabytes of tokens).

    Gym writes both row kinds with sorted keys (``TokenCaptureStore``: orjson with ``OPT_SORT_KEYS``;
    ``FileLineageStore``: ``json.dumps(sort_keys=True)``), and every key that sorts before
    ``model_call_id`` in either holds a scalar or a list of numbers, so the first ``"model_call_id":"``
    of a line is the row's own (a quote inside a JSON string is escaped, never matched). None when absent.
    """
    start = line.find(_ID_KEY)
    if start < 0:
        return None
    start += len(_ID_KEY)
    end = line.find(b'"', start)
    return line[start:end].decode() if end > start else None


def unpack_line(key: str, packed: Any) -> tuple[str, bytes]:
    """``(model call id, line with its newline)`` of a restored row stored as ``[id, its line as text]``."""
    if type(packed) is not list or len(packed) != 2 or type(packed[0]) is not str or type(packed[1]) is not str:
        raise _refuse(key, "a captured row must be [model call id, its JSON line]")
    call_id, text = packed
    line = text.encode()
    if line[:1] != b"{" or line[-1:] != b"}" or b"\n" in line or row_id_of(line) != call_id:
        raise _refuse(key, f"captured row {call_id}: its line is not one JSON row of that model call")
    return call_id, line + b"\n"


def ledger_line(row: Mapping[str, Any]) -> bytes:
    # FileLineageStore's own encoding of a ledger row (sorted keys, compact, ASCII).
    return json.dumps(row, sort_keys=True, separators=(",", ":")).encode() + b"\n"


# Gym's validate_rollout_id (ASCII letters, digits and ._-): a file name in the capture directory.
_gym_key = re.compile(r"[A-Za-z0-9._-]+").fullmatch
