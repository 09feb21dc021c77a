"""Restored records the coordinator holds until the worker that receives their replacement claims them.

A restore installs its records into the coordinator (``hold``), not into any worker: which
worker gets the replacement attempt is up to the port's load balancing and Gym's session routing.
The worker that receives it claims the record (``claim``), and from then on it is that worker's
alone (one owner): a second worker's claim is refused ``attempt_running``. A claimed record is
dropped here (its worker holds it); a worker whose local install failed gives it back (``unclaim``).

Until claimed, a record is the coordinator's: ``pending`` names it (restored, not started), a
commit exports it (``exported``: the record under its replacement attempt, which is what an
installed, not yet started episode of the in-test participants exports too), a commit that leaves
it out of scope or a retire of its replacement drops it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from nemo_gym_checkpoint_plugin._errors import AttemptRunning
from nemo_gym_checkpoint_plugin._identity import EpisodeId, episode_to_wire
from nemo_gym_checkpoint_plugin._types import RestoredRecord

__all__ = ["RestoredRecords"]


class RestoredRecords:
    """Unclaimed restored records by replacement capture key, and who claimed the others."""

    def __init__(self) -> None:
        self.checkpoint_id: str | None = None
        self.manifest: Mapping[str, Any] = {}
        # A replacement may have several records (one per plugin of the participant): all go to one owner.
        self._unclaimed: dict[str, list[RestoredRecord]] = {}
        self._owners: dict[str, str] = {}

    def hold(self, checkpoint_id: str, manifest: Mapping[str, Any], records: Iterable[RestoredRecord]) -> None:
        self.checkpoint_id = checkpoint_id
        self.manifest = manifest
        for restored in records:
            key = restored.replacement.capture_key
            self._owners.pop(key, None)
            self._unclaimed.setdefault(key, []).append(restored)

    def claim(self, episode: EpisodeId, worker: str) -> list[RestoredRecord] | None:
        """The records of replacement ``episode`` for ``worker`` (None: none held); ``AttemptRunning`` if taken."""
        key = episode.capture_key
        owner = self._owners.get(key)
        if owner is not None and owner != worker:
            raise AttemptRunning(
                f"the restored record of {key} was claimed by {owner}: its replacement runs there, not on {worker}",
                episodes=[key],
            )
        records = self._unclaimed.pop(key, None)
        if records is None:
            return None
        self._owners[key] = worker
        return records

    def unclaim(self, episode: EpisodeId, worker: str, records: Iterable[RestoredRecord]) -> None:
        key = episode.capture_key
        if self._owners.get(key) == worker:
            del self._owners[key]
            self._unclaimed.setdefault(key, []).extend(records)

    def owner(self, episode: EpisodeId) -> str | None:
        return self._owners.get(episode.capture_key)

    def pending(self) -> set[str]:
        return set(self._unclaimed)

    def drop(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._unclaimed.pop(key, None)

    def drop_retired(self, episodes: Iterable[EpisodeId]) -> None:
        """Drop unclaimed records whose replacement is now retired (``episodes``: retired up to each attempt)."""
        up_to: dict[str, int] = {}
        for episode in episodes:
            up_to[episode.rollout_id] = max(episode.attempt, up_to.get(episode.rollout_id, -1))
        for key, records in list(self._unclaimed.items()):
            replacement = records[0].replacement
            if replacement.attempt <= up_to.get(replacement.rollout_id, -1):
                del self._unclaimed[key]

    def exported(self, scope: frozenset[str] | None) -> list[dict[str, Any]]:
        """The unclaimed records inside ``scope``, each under its replacement attempt."""
        out = []
        for key in sorted(self._unclaimed):
            if scope is not None and key not in scope:
                continue
            for restored in self._unclaimed[key]:
                out.append({**restored.record, "episode_id": episode_to_wire(restored.replacement)})
        return out
