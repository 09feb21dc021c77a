"""Gym's training-token capture across a checkpoint (the model participant's records).

With nemo-gym 0.7.0's ``token_id_capture`` block on and its file store in use
(``TokenCaptureStore``: ``<capture key>.tokens.jsonl`` per episode attempt, the rows Gym's
rebuild ``trajectories_for_rollout`` reads, and that ``FileLineageStore`` resolves parents
from), a restored rollout runs as attempt N+1 and records its new calls under ``r-a<N+1>``
while its earlier calls stay under ``r-a<N>``. So:

- ``export`` reads each in-scope episode's captured rows, minus those of calls whose response
  has not started reaching the caller (held, or generating: the agent sends them again as
  N+1), one record per episode: ``{"episode_id", "token_entries": [row, ...]}``;
- ``install`` first clears what dead executions left for attempt N+1 and later of every
  episode in the restore's scope (entries, intents, incomplete marker, state), then writes the
  rows under the replacement attempt's key, each row unchanged: it keeps the capture key it
  was first recorded under in its own ``rollout_id``;
- ``delete`` removes an installed attempt's files entirely, so nothing (a frozen or retired
  state) refuses the attempt when it starts later.

Rows are written as the store writes them (sorted-key JSON lines, fsynced, under its
per-rollout lock); the store rebuilds its index from the file on its next use.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import orjson

from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState
from nemo_gym_checkpoint_plugin._identity import EpisodeId, from_capture_key

__all__ = ["TokenCaptures", "token_captures_for"]

_SUFFIXES = (".tokens.jsonl", ".tokens.intents", ".tokens.incomplete", ".tokens.state.json")


def token_captures_for(server: Any) -> TokenCaptures | None:
    """The capture store of a model server's config, when token capture writes Gym's file store; else None."""
    global_config = getattr(getattr(server, "server_client", None), "global_config_dict", None)
    if global_config is None:
        return None
    from nemo_gym.token_id_capture.store import make_token_store

    store = make_token_store(global_config)
    return None if store is None else TokenCaptures(store)


class TokenCaptures:
    """Export, install and delete the captured rows of episode attempts in one ``TokenCaptureStore``."""

    def __init__(self, store: Any) -> None:
        self.store = store

    # -- export ------------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Capture keys with captured rows in the store (an unscoped export)."""
        suffix = ".tokens.jsonl"
        return sorted(p.name[: -len(suffix)] for p in self.store.root.glob(f"*{suffix}"))

    def export(self, keys: Iterable[str], excluded: Callable[[str], set[str | None]]) -> Iterator[dict[str, Any]]:
        """One record per key with rows, leaving out the model call ids ``excluded(key)`` names once they were read.

        Lazy: the storage writer advances it in its worker thread, one episode's rows in memory at a time.
        """
        for key in keys:
            try:
                episode = from_capture_key(key)
            except ValueError:
                continue  # not an episode attempt's file
            rows = [entry.model_dump(mode="json") for entry in self.store.read_entries(key)]
            skip = excluded(key)
            rows = [row for row in rows if row["model_call_id"] not in skip]
            if rows:
                yield {
                    "episode_id": {"rollout_id": episode.rollout_id, "attempt": episode.attempt},
                    "token_entries": rows,
                }

    # -- install -----------------------------------------------------------------------------------

    def validate(self, key: str, record: Mapping[str, Any]) -> list[bytes]:
        """The lines to write for one restored record; ``InvalidCheckpointState`` for a bad one."""
        from nemo_gym.token_id_capture.records import TokenEntry

        rows = record.get("token_entries")
        if not isinstance(rows, list):
            raise InvalidCheckpointState(f"episode {key}: token_entries must be a list", episode=key)
        lines = []
        seen: set[str] = set()
        for row in rows:
            try:
                entry = TokenEntry.model_validate(row)
            except ValueError as exc:
                raise InvalidCheckpointState(f"episode {key}: a token entry is invalid: {exc}", episode=key) from None
            if entry.model_call_id in seen:
                raise InvalidCheckpointState(f"episode {key}: model call {entry.model_call_id} twice", episode=key)
            seen.add(entry.model_call_id)
            lines.append(orjson.dumps(entry.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS) + b"\n")
        return lines

    def clear_from(self, replacement: EpisodeId) -> None:
        """Delete every file of attempts ``replacement.attempt`` and later of its rollout (dead executions)."""
        rollout = replacement.rollout_id
        for path in self.store.root.glob(f"{rollout}-a*.tokens.*"):
            name = path.name
            suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
            if suffix is None:
                continue
            try:
                episode = from_capture_key(name[: -len(suffix)])
            except ValueError:
                continue
            if episode.rollout_id == rollout and episode.attempt >= replacement.attempt:
                self.delete(episode.capture_key)

    def write(self, key: str, lines: list[bytes]) -> None:
        """Write ``lines`` as the rows of ``key`` (which ``clear_from`` emptied), durably."""
        path = self.store.path_for(key)
        with self.store._locked(key):  # the store's own per-rollout lock: no writer interleaves
            with path.open("ab") as handle:
                handle.writelines(lines)
                handle.flush()
                os.fsync(handle.fileno())
        self._fsync_root()

    def delete(self, key: str) -> None:
        """Remove every file of ``key`` but its lock (Gym's ``delete``: a later attempt starts clean)."""
        self.store.delete(key)

    def _fsync_root(self) -> None:
        descriptor = os.open(self.store.root, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
