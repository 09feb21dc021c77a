"""The checkpoint plugin of ``TallyResourcesServer``, written only against ``nemo_gym_checkpoint_plugin.api``.

Published in the ``nemo_gym_checkpoint`` entry-point group (``pyproject.toml``), so every Gym
server of a checkpointing deployment loads it; ``attach`` keeps it only on a
``TallyResourcesServer`` (matched by class name: Gym runs the server from its directory as the
top-level module ``app``, so the class object is not this package's ``tally_verifier.app`` one).

One record per episode, its tally: ``{"episode_id", "session_id", "resources_session_id",
"target", "total"}`` (the control plane adds ``"plugin": "tally_verifier"``). The server's
config declares ``checkpoint_mode: export_restore`` so the built-in resources participant leaves
these episodes capturable; this plugin declares, per seed, the tasks it cannot capture
(``task_data`` ``"checkpointable": false``) restarts, and every other ``/verify`` replayable
(it reads the tally and changes nothing).

A tally changes only inside one ``/add`` request, and a checkpoint closes admission before it
asks ``ready``: nothing of ours is ever half-done, so there are no blockers and no ``wait_ready``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nemo_gym_checkpoint_plugin.api import (
    EpisodeId,
    InvalidCheckpointState,
    ParticipantExport,
    Readiness,
    RestoredRecord,
    SeedDeclaration,
    episode_to_wire,
    from_capture_key,
    hookimpl,
    make_episode_id,
)

__all__ = ["TallyCheckpoint", "plugin"]

SERVER_CLASS = "TallyResourcesServer"


def _episode(tally: Any) -> EpisodeId:
    return make_episode_id(tally.rollout_id, tally.attempt)


class TallyCheckpoint:
    """Checkpoints ``server.tallies`` ({Gym session id: Tally}) of a ``TallyResourcesServer``."""

    def __init__(self) -> None:
        self.server: Any = None
        self.restored: set[str] = set()  # replacement capture keys installed and not started yet

    @hookimpl
    def attach(self, server: Any, kind: str) -> bool:
        if kind != "resources" or SERVER_CLASS not in (cls.__name__ for cls in type(server).__mro__):
            return False  # not our server: take no part in this process
        self.server = server
        self.restored = set()  # one attach per server process: nothing restored yet
        return True

    # -- declarations --------------------------------------------------------------------------

    @hookimpl
    def seed_session(self, episode_id: EpisodeId, session: Mapping[str, Any]) -> SeedDeclaration:
        task_data = session.get("task_data")
        if isinstance(task_data, Mapping) and task_data.get("checkpointable") is False:
            return SeedDeclaration(restart=True)
        return SeedDeclaration(verify_replay=True)

    # -- checkpoint ----------------------------------------------------------------------------

    @hookimpl
    def ready(self, checkpoint_id: str | None) -> Readiness:
        restarts = sorted(_episode(t).capture_key for t in self.server.tallies.values() if not t.checkpointable)
        return Readiness(restarts=restarts, counts={"tallies": len(self.server.tallies)})

    @hookimpl
    def export(self, checkpoint_id: str, scope: frozenset[str] | None) -> ParticipantExport:
        records = []
        for session_id, tally in sorted(self.server.tallies.items()):
            episode = _episode(tally)
            if not tally.checkpointable or (scope is not None and episode.capture_key not in scope):
                continue  # never export a restart; only episodes in scope
            records.append(
                {
                    "episode_id": episode_to_wire(episode),
                    "session_id": session_id,
                    "resources_session_id": tally.resources_session_id,
                    "target": tally.target,
                    "total": tally.total,
                }
            )
        return ParticipantExport(records=records)

    # -- restore -------------------------------------------------------------------------------

    @hookimpl
    def install(self, records: list[RestoredRecord], scope: list[EpisodeId]) -> None:
        tally_class = _tally_class(self.server)
        staged: dict[str, Any] = {}
        for restored in records:
            record, key = restored.record, restored.checkpointed.capture_key
            session_id = record.get("session_id")
            fields = {name: record.get(name) for name in ("target", "total")}
            if not isinstance(session_id, str) or not session_id:
                raise InvalidCheckpointState(f"episode {key}: session_id is missing")
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in fields.values()):
                raise InvalidCheckpointState(f"episode {key}: target and total must be integers, got {fields}")
            if not isinstance(record.get("resources_session_id"), str):
                raise InvalidCheckpointState(f"episode {key}: resources_session_id is missing")
            if session_id in self.server.tallies or session_id in staged:
                raise InvalidCheckpointState(f"episode {key}: session {session_id} already holds a tally")
            staged[session_id] = tally_class(
                rollout_id=restored.replacement.rollout_id,
                attempt=restored.replacement.attempt,
                resources_session_id=record["resources_session_id"],
                **fields,
            )
        # Validated: install all at once (a refused install leaves nothing installed).
        self.server.tallies.update(staged)
        self.restored.update(_episode(tally).capture_key for tally in staged.values())

    @hookimpl
    def restored_pending(self) -> list[str]:
        return sorted(self.restored)

    @hookimpl
    def delete_restored(self, episode_ids: list[EpisodeId]) -> None:
        keys = {episode.capture_key for episode in episode_ids}
        self._drop(lambda episode: episode.capture_key in keys)
        self.restored -= keys

    @hookimpl
    def retire(self, episode_ids: list[EpisodeId]) -> None:
        limits: dict[str, int] = {}
        for episode in episode_ids:
            limits[episode.rollout_id] = max(limits.get(episode.rollout_id, -1), episode.attempt)

        def named(episode: EpisodeId) -> bool:  # the named attempts and earlier ones of their rollouts
            return episode.attempt <= limits.get(episode.rollout_id, -1)

        self._drop(named)
        self.restored = {key for key in self.restored if not named(from_capture_key(key))}

    @hookimpl
    def status_fields(self) -> dict[str, Any]:
        return {"tally_sessions": len(self.server.tallies)}

    def _drop(self, named: Any) -> None:
        for session_id in [s for s, t in self.server.tallies.items() if named(_episode(t))]:
            del self.server.tallies[session_id]


def _tally_class(server: Any) -> type:
    # The Tally model of the module the server was loaded from (``app`` when Gym runs it from its directory).
    import sys

    for cls in type(server).__mro__:
        if cls.__name__ == SERVER_CLASS:
            return sys.modules[cls.__module__].Tally
    raise LookupError(f"{type(server).__name__} is not a {SERVER_CLASS}")


plugin = TallyCheckpoint()
