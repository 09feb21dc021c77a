"""Counts per rollout and attempt, kept while the rollout is in flight (the lost-work ledger's figures).

The model participant counts answered calls and their output tokens, the resources participant answered
tool calls; each reports them per capture key in its commit reply and drops a rollout's counts when it is
forgotten, and an attempt's (with every earlier one) when it is retired.
"""

from __future__ import annotations

from collections.abc import Iterable

from nemo_gym_checkpoint_plugin._identity import EpisodeId, capture_key

__all__ = ["AttemptCounts"]


class AttemptCounts:
    """``{rollout_id: {attempt: count}}`` with the ledger's add, retire, forget and per-key view."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[str, dict[int, int]] = {}

    def add(self, rollout_id: str, attempt: int, amount: int = 1) -> None:
        attempts = self._counts.setdefault(rollout_id, {})
        attempts[attempt] = attempts.get(attempt, 0) + amount

    def retire(self, episode_ids: Iterable[EpisodeId]) -> None:
        """Drop each episode's attempt and every earlier one of its rollout."""
        for episode in episode_ids:
            attempts = self._counts.get(episode.rollout_id)
            if attempts is None:
                continue
            for attempt in [a for a in attempts if a <= episode.attempt]:
                del attempts[attempt]
            if not attempts:
                del self._counts[episode.rollout_id]

    def forget(self, rollout_ids: Iterable[str]) -> None:
        for rollout_id in rollout_ids:
            self._counts.pop(rollout_id, None)

    def by_key(self) -> dict[str, int]:
        """Every count by capture key (``api.capture_key``)."""
        return {
            capture_key(rollout_id, attempt): count
            for rollout_id, attempts in self._counts.items()
            for attempt, count in attempts.items()
        }
