"""``single_agent_turn_legacy``'s flat-row wrapper: an explicit ``"<id>-aN"`` rollout id is attempt N of ``<id>``.

Gym's ``SingleAgentTurnLegacyEnvironmentServer._episode_request_from_row`` builds the episode
from a flat row as ``EpisodeId(rollout_id=<_ng_rollout_id>, attempt=<_ng_attempt_index or 0>)``.
An explicit id ending in ``-aN`` (how a controller names attempt N of a rollout; Gym's capture
key and the protocol's explicit-id rule) is refused there, since Gym reserves that suffix. With
checkpointing on (an episode book bound), this mixin decodes it first, as the admission gate
already does for the same row (``_gate.episode_of_run_body``): the row becomes attempt N of
``<id>``. A suffix together with a non-zero attempt index is ambiguous and refused with 422
``ambiguous_episode_id`` naming both. Without a book the row goes to Gym's method untouched.
"""

from __future__ import annotations

from typing import Any

from nemo_gym.global_config import ATTEMPT_INDEX_KEY_NAME, ROLLOUT_ID_KEY_NAME

from nemo_gym_checkpoint_plugin._errors import AmbiguousEpisode
from nemo_gym_checkpoint_plugin._identity import AmbiguousEpisodeId, make_episode_id

__all__ = ["LegacyRowIds"]


class LegacyRowIds:
    """Mixin listed before ``SingleAgentTurnSteps`` for a server with Gym's legacy flat-row wrapper."""

    def _episode_request_from_row(self, row: dict[str, Any]) -> Any:
        explicit = row.get(ROLLOUT_ID_KEY_NAME)
        if getattr(self, "_ng_episode_book", None) is None or not isinstance(explicit, str):
            return super()._episode_request_from_row(row)  # type: ignore[misc]
        attempt = row.get(ATTEMPT_INDEX_KEY_NAME)
        try:
            episode = make_episode_id(explicit, attempt if isinstance(attempt, int) and attempt > 0 else None)
        except AmbiguousEpisodeId as exc:
            raise AmbiguousEpisode(str(exc), rollout_id=explicit, attempt=attempt) from None
        if episode.rollout_id == explicit:
            return super()._episode_request_from_row(row)  # type: ignore[misc]
        decoded = {**row, ROLLOUT_ID_KEY_NAME: episode.rollout_id, ATTEMPT_INDEX_KEY_NAME: episode.attempt}
        return super()._episode_request_from_row(decoded)  # type: ignore[misc]
