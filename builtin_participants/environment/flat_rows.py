"""``single_agent_turn_legacy``'s flat-row wrapper: an explicit ``"<id>-aN"`` rollout id is attempt N of ``<id>``.

Gym's ``SingleAgentTurnLegacyEnvironmentServer._episode_request_from_row`` builds the episode
from a flat row as ``EpisodeId(rollout_id=<_ng_rollout_id>, attempt=<_ng_attempt_index or 0>)``.
An explicit id ending in ``-aN`` (how a controller names attempt N of a rollout; Gym's capture
key and the protocol's explicit-id rule) is refused there, since Gym reserves that suffix. With
checkpointing on (an episode book bound), this mixin decodes it first, as the admission gate
already does for the same row (``_gate.episode_of_run_body``): the row becomes attempt N of
``<id>``. A suffix together with a non-zero attempt index is ambiguous and refused with 422
``ambiguous_episode_id`` naming both. A row Gym's method cannot turn into an episode (its
``ValueError``: a row continuing a restored rollout by hand with only ``_ng_rollout_id``, and
so no task identity) is refused with 422 ``invalid_run_request`` instead of Gym's 500.
Without a book the row goes to Gym's method untouched.
"""

from __future__ import annotations

from typing import Any

from nemo_gym.global_config import ATTEMPT_INDEX_KEY_NAME, ROLLOUT_ID_KEY_NAME, TASK_INDEX_KEY_NAME

from nemo_gym_checkpoint_plugin._errors import AmbiguousEpisode, InvalidRunRequest
from nemo_gym_checkpoint_plugin._identity import AmbiguousEpisodeId, make_episode_id

__all__ = ["LegacyRowIds"]


class LegacyRowIds:
    """Mixin listed before ``SingleAgentTurnSteps`` for a server with Gym's legacy flat-row wrapper."""

    def _episode_request_from_row(self, row: dict[str, Any]) -> Any:
        explicit = row.get(ROLLOUT_ID_KEY_NAME)
        if getattr(self, "_ng_episode_book", None) is None:
            return super()._episode_request_from_row(row)  # type: ignore[misc]
        if not isinstance(explicit, str):
            return self._gym_request(row)
        attempt = row.get(ATTEMPT_INDEX_KEY_NAME)
        try:
            episode = make_episode_id(explicit, attempt if isinstance(attempt, int) and attempt > 0 else None)
        except AmbiguousEpisodeId as exc:
            raise AmbiguousEpisode(str(exc), rollout_id=explicit, attempt=attempt) from None
        if episode.rollout_id == explicit:
            return self._gym_request(row)
        decoded = {**row, ROLLOUT_ID_KEY_NAME: episode.rollout_id, ATTEMPT_INDEX_KEY_NAME: episode.attempt}
        return self._gym_request(decoded)

    def _gym_request(self, row: dict[str, Any]) -> Any:
        """Gym's conversion of the row; its refusals of bad input (a 500 from Gym) typed as 422."""
        try:
            return super()._episode_request_from_row(row)  # type: ignore[misc]
        except KeyError as exc:
            # Gym indexes the row for a rollout id it cannot find; only a row with neither id gets here.
            detail = f"the row has no {exc.args[0]!r} and no {ROLLOUT_ID_KEY_NAME!r}"
            raise InvalidRunRequest(_hinted(detail), rollout_id=row.get(ROLLOUT_ID_KEY_NAME)) from None
        except ValueError as exc:  # pydantic's ValidationError included: Gym's own models refused the row
            raise InvalidRunRequest(_hinted(str(exc)), rollout_id=row.get(ROLLOUT_ID_KEY_NAME)) from None


def _hinted(gym_says: str) -> str:
    return (
        f"this flat row cannot become an episode: {gym_says}; a row continuing a restored rollout is the "
        f"collection's row again: its task fields (task_id, or {TASK_INDEX_KEY_NAME!r}) and "
        f"{ROLLOUT_ID_KEY_NAME!r} naming the next attempt (see docs/trainer.md)"
    )
