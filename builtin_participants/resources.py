"""The resources participant: seed declarations, session bindings across a crash, seed counts.

What a resources server must keep for a restored episode to reuse its session:

- ``example_single_tool_call`` binds each ``resources_session_id`` to its episode and
  task in memory (``_session_episodes``); ``/close_session`` refuses an episode that does
  not match the binding, and a closed id may never be seeded again. Tools and
  ``/verify`` need nothing else (the verdict is computed from the response). So this
  participant exports the bindings of the episodes in scope (``{"episode_id",
  "resources_session_id", "task_id"}``) and installs them bound to the replacement
  attempt, which is the attempt whose cleanup closes the session.
- A server that declares its ``checkpoint_mode`` (``declarations.py``: its config key, or
  the built-in table of the wheel's stateless verifiers) is taken at its word:
  ``stateless`` -> capturable, and every seed declares ``/verify`` replayable
  (``x-ng-checkpoint-verify: replay``); ``export_restore`` -> capturable, a plugin exports
  the state (and declares replay itself if it may); ``restart_only`` -> every seed a restart.
- Undeclared: a server whose ``seed_session`` is Gym's default keeps no per-episode state:
  nothing to export, its episodes are capturable (``/verify`` not declared replayable).
  Any other server keeps state this participant does not know: every session it seeds
  is declared a **restart** (``x-ng-checkpoint-restart`` on the seed reply).
- This participant only declares what it knows: for a capturable episode of an undeclared
  or ``export_restore`` server it answers no declaration, so a plugin's
  ``SeedDeclaration(verify_replay=True)`` is not overruled.
- A task may declare itself not capturable (e.g. external side effects that cannot be
  re-attached): ``task_data`` ``{"ng_checkpoint": "restart"}`` makes its session a restart.

Seeds are counted here (``status``: ``seed_session_calls`` and, for the most recent
rollouts, ``seed_sessions_by_rollout``), because a controller cannot see whether a step
ran again after a restart; tests and the demo read these counts.

The seed hook is called by ``install_resources_declarations``' middleware once the
server's ``/seed_session`` handler replied 2xx; the replies of ``/close_session`` end the
tracking of a session.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import orjson
from nemo_gym_checkpoint_plugin.builtin_participants.declarations import CheckpointMode, declared_mode

from nemo_gym_checkpoint_plugin.gate import json_as_gym_reads
from nemo_gym_checkpoint_plugin.identity import EpisodeId, episode_from_wire
from nemo_gym_checkpoint_plugin.markers import hookimpl
from nemo_gym_checkpoint_plugin.types import Readiness, RestoredRecord, SeedDeclaration

__all__ = ["RESTART_TASK_KEY", "ResourcesSessions", "install_resources_declarations"]

RESTART_TASK_KEY = "ng_checkpoint"
# How many rollouts' seed counts status keeps (a diagnostic; the oldest are dropped first).
_SEED_COUNT_ROLLOUTS = 10_000


def _stateless(server: Any) -> bool:
    from nemo_gym.base_resources_server import SimpleResourcesServer

    return type(server).seed_session is SimpleResourcesServer.seed_session


class ResourcesSessions:
    """Participant plugin of a Gym resources server (see the module docstring)."""

    def __init__(self, server: Any) -> None:
        self.server = server
        table = getattr(server, "_session_episodes", None)
        self._table: dict[str, Any] | None = table if isinstance(table, dict) else None
        # Raises SettingsError (the server does not start) for a bad checkpoint_mode value.
        self.mode = declared_mode(server)
        if self.mode is None:
            self.capturable = self._table is not None or _stateless(server)
        else:
            self.capturable = self.mode is not CheckpointMode.RESTART_ONLY
        self.verify_replay = self.mode is CheckpointMode.STATELESS
        self.restart_warning = None if self.capturable or self.mode is not None else _restart_warning(server)
        self.seed_calls = 0
        self.seeds_by_rollout: OrderedDict[str, int] = OrderedDict()
        self._restarts: set[str] = set()
        self._installed: dict[str, str] = {}  # replacement capture key -> resources_session_id

    # -- seeds and closes (from the middleware) ---------------------------------------------------

    @hookimpl
    def seed_session(self, episode_id: EpisodeId, session: Mapping[str, Any]) -> SeedDeclaration | None:
        self.seed_calls += 1
        rollout = episode_id.rollout_id
        self.seeds_by_rollout[rollout] = self.seeds_by_rollout.pop(rollout, 0) + 1
        while len(self.seeds_by_rollout) > _SEED_COUNT_ROLLOUTS:
            self.seeds_by_rollout.popitem(last=False)
        task_data = session.get("task_data")
        declared = isinstance(task_data, Mapping) and task_data.get(RESTART_TASK_KEY) == "restart"
        restart = declared or not self.capturable
        if restart:
            self._restarts.add(episode_id.capture_key)
            return SeedDeclaration(restart=True)
        if self.verify_replay:
            return SeedDeclaration(verify_replay=True)
        return None  # nothing known to declare: another plugin's declaration stands

    def session_closed(self, episode_id: EpisodeId) -> None:
        self._restarts.discard(episode_id.capture_key)
        self._installed.pop(episode_id.capture_key, None)

    # -- participant hooks -------------------------------------------------------------------------

    @hookimpl
    def ready(self, checkpoint_id: str | None) -> Readiness:
        return Readiness(restarts=list(self._restarts))

    @hookimpl
    def export(self, checkpoint_id: str, scope: frozenset[str] | None) -> list[dict[str, Any]]:
        if self._table is None:
            return []
        records = []
        for session_id, binding in self._table.items():
            episode_id, task_id = binding
            key = episode_id.capture_key
            if key in self._restarts or (scope is not None and key not in scope):
                continue
            records.append(
                {
                    "episode_id": {"rollout_id": episode_id.rollout_id, "attempt": episode_id.attempt},
                    "resources_session_id": session_id,
                    "task_id": task_id.model_dump(mode="json"),
                }
            )
        return records

    @hookimpl
    def install(self, checkpoint_id: str, manifest: Mapping[str, Any], records: list[RestoredRecord]) -> None:
        if self._table is None:
            if records:
                raise ValueError(f"{type(self.server).__name__} keeps no session bindings; it cannot install any")
            return
        from nemo_gym.episode_types import TaskId

        staged: dict[str, Any] = {}
        for restored in records:
            session_id = restored.record.get("resources_session_id")
            if not isinstance(session_id, str) or not session_id:
                raise ValueError(f"episode {restored.checkpointed.capture_key}: resources_session_id is missing")
            if session_id in self._table or session_id in staged:
                raise ValueError(f"episode {restored.checkpointed.capture_key}: session {session_id} already exists")
            staged[session_id] = (restored.replacement, TaskId.model_validate(restored.record.get("task_id")))
        self._table.update(staged)
        for session_id, (episode_id, _task) in staged.items():
            self._installed[episode_id.capture_key] = session_id

    @hookimpl
    def restored_pending(self) -> list[str]:
        return list(self._installed)

    @hookimpl
    def delete_restored(self, episode_ids: list[EpisodeId]) -> None:
        for episode_id in episode_ids:
            session_id = self._installed.pop(episode_id.capture_key, None)
            if session_id is not None and self._table is not None:
                self._table.pop(session_id, None)

    @hookimpl
    def retire(self, episode_ids: list[EpisodeId]) -> None:
        limits: dict[str, int] = {}
        for episode_id in episode_ids:
            limits[episode_id.rollout_id] = max(limits.get(episode_id.rollout_id, -1), episode_id.attempt)

        def named(episode_id: EpisodeId) -> bool:
            return episode_id.attempt <= limits.get(episode_id.rollout_id, -1)

        for key in [k for k in self._restarts if named(_key_episode(k))]:
            self._restarts.discard(key)
        for key in [k for k in self._installed if named(_key_episode(k))]:
            session_id = self._installed.pop(key)
            if self._table is not None:
                self._table.pop(session_id, None)
        if self._table is not None:
            # A retired attempt's live binding too: its environment may be gone and never close it,
            # and a kept binding would be exported by every later unscoped checkpoint.
            for session_id in [s for s, (episode_id, _task) in self._table.items() if named(episode_id)]:
                del self._table[session_id]

    @hookimpl
    def status_fields(self) -> dict[str, Any]:
        return {
            "capturable": self.capturable,
            "checkpoint_mode": self.mode.value if self.mode is not None else None,
            "seed_session_calls": self.seed_calls,
            "seed_sessions_by_rollout": dict(self.seeds_by_rollout),
            "restart_warning": self.restart_warning,
        }


def _restart_warning(server: Any) -> str:
    """Why every episode of this undeclared server is a restart, and what its author can do (status and log)."""
    config = getattr(server, "config", None)
    name = getattr(config, "name", None) or type(server).__name__
    return (
        f"resources server {name!r} ({type(server).__name__}) has its own seed_session and declares no "
        "checkpoint_mode, so every episode it seeds is a restart: its rollouts start over after a crash. "
        "If it keeps nothing per session, declare `checkpoint_mode: stateless` in its config block; if it does, "
        "implement the participant hooks export and install (with retire and delete_restored) in a plugin "
        "(docs/plugins.md) and declare `checkpoint_mode: export_restore`; `checkpoint_mode: restart_only` "
        "says restarts are intended."
    )


def _key_episode(key: str) -> EpisodeId:
    from nemo_gym_checkpoint_plugin.identity import from_capture_key

    return from_capture_key(key)


def _episode_of(body: bytes) -> tuple[EpisodeId, dict[str, Any]] | None:
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


def install_resources_declarations(app: Any, participants: Any, sessions: ResourcesSessions) -> None:
    """Call the ``seed_session`` hook after each successful seed (its headers join the reply); track closes."""
    from nemo_gym_checkpoint_plugin.builtin_participants.replies import ReplyHeaders

    async def on_seed(body: bytes, status: int) -> dict[str, str]:
        found = _episode_of(body) if 200 <= status < 300 else None
        if found is None:
            return {}
        episode_id, session = found
        return await participants.seed_session(episode_id, session)

    async def on_close(body: bytes, status: int) -> dict[str, str]:
        found = _episode_of(body) if 200 <= status < 300 else None
        if found is not None:
            sessions.session_closed(found[0])
        return {}

    app.add_middleware(ReplyHeaders, path="/seed_session", headers_for=on_seed)
    app.add_middleware(ReplyHeaders, path="/close_session", headers_for=on_close)
