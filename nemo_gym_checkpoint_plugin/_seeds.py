"""The ``seed_session`` hook on a resources server's seed replies (installed by the attachment).

After each successful ``POST /seed_session`` (prefixed or not) the participant's ``seed_session``
hooks are called with the episode the request named and its body; the headers their declarations
merge into (``x-ng-checkpoint-restart``, ``x-ng-checkpoint-verify``) join the reply. Part of the
wiring, not of a plugin: every plugin answering ``seed_session`` is called, built-in or third party.
"""

from __future__ import annotations

from typing import Any

import orjson

from nemo_gym_checkpoint_plugin._gate import json_as_gym_reads
from nemo_gym_checkpoint_plugin._identity import EpisodeId, episode_from_wire

__all__ = ["install_seed_hook", "seeded_episode"]


def seeded_episode(body: bytes) -> tuple[EpisodeId, dict[str, Any]] | None:
    """The episode a session request body names and the body itself; None when it names none."""
    try:
        try:
            data = orjson.loads(body)
        except ValueError:
            data = json_as_gym_reads(body)  # UTF-16/32, a BOM, NaN: Gym's route reads those too
        if not isinstance(data, dict) or "episode_id" not in data:
            return None
        return episode_from_wire(data["episode_id"]), data
    except ValueError:
        return None


def install_seed_hook(app: Any, participants: Any) -> None:
    """Call ``participants.seed_session`` after each successful seed; its headers join the reply."""
    from nemo_gym_checkpoint_plugin.builtin_participants.shared.reply_headers import ReplyHeaders

    async def on_seed(body: bytes, status: int) -> dict[str, str]:
        found = seeded_episode(body) if 200 <= status < 300 else None
        if found is None:
            return {}
        episode_id, session = found
        return await participants.seed_session(episode_id, session)

    app.add_middleware(ReplyHeaders, path="/seed_session", headers_for=on_seed)
