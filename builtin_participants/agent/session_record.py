"""One open agent session's record, built from the parts ``SimpleAgentSessions.export`` took (open_sessions.py).

Called in the checkpoint writer's thread, only for a session whose version changed since the
server's previous checkpoint (``api.Versioned``); the record is what the export built before.
"""

from __future__ import annotations

from typing import Any

from nemo_gym_checkpoint_plugin.builtin_participants.agent.turn_journal import Turn

__all__ = ["session_record"]


def session_record(
    episode: dict[str, Any],
    session_id: str,
    request: dict[str, Any],
    cookies: dict[str, str],
    activations: int,
    observations: Any,
    turn: Turn | None,
    calls: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """One open session's record, from the parts ``export`` took."""
    entry = {
        "episode_id": episode,
        "agent_session_id": session_id,
        "request": request,
        "resources_cookies": cookies,
        "activations": activations,
    }
    # No observations and no turn are left out rather than written as null (the install reads a
    # missing one as None): a line without ``null`` skips the writer's NaN walk (codec.py).
    if observations is not None:
        entry["observations"] = observations.model_dump(mode="json")
    if turn is not None:
        entry["turn"] = turn.to_wire(calls)
    return entry
