"""The resources participant: seed declarations, session bindings across a crash, seed counts.

What a resources server must keep for a restored episode to reuse its session:

- ``example_single_tool_call`` binds each ``resources_session_id`` to its episode and
  task in memory (``_session_episodes``); ``/close_session`` refuses an episode that does
  not match the binding, and a closed id may never be seeded again. Tools and
  ``/verify`` need nothing else (the verdict is computed from the response). So this
  participant exports the bindings of the episodes in scope (``{"episode_id",
  "resources_session_id", "task_id"}``) and installs them bound to the replacement
  attempt, which is the attempt whose cleanup closes the session.
- A server that declares its ``checkpoint_mode`` (``checkpoint_modes.py``: its config key, or
  the built-in table of the wheel's stateless verifiers) is taken at its word:
  ``stateless`` -> capturable, and every seed declares ``/verify`` replayable
  (``x-ng-checkpoint-verify: replay``); ``export_restore`` -> capturable, a plugin exports
  the state (and declares replay itself if it may); ``restart_only`` -> every seed a restart.
- A server with **session state** (``checkpoint_session_state:`` in its config, or the built-in
  table of ``checkpoint_modes.py``) is ``export_restore``: its named per-session dicts are exported
  and installed per episode by ``session_state.py`` (a record's ``session_state`` field), with no
  plugin of its own.
- Undeclared: a server whose ``seed_session`` is Gym's default keeps no per-episode state:
  nothing to export, its episodes are capturable (``/verify`` not declared replayable).
  Any other server keeps state this participant does not know: every session it seeds
  is declared a **restart** (``x-ng-checkpoint-restart`` on the seed reply).
- This participant only declares what it knows: for a capturable episode of an undeclared
  or ``export_restore`` server it answers no declaration, so a plugin's
  ``SeedDeclaration(verify_replay=True)`` is not overruled.
- A task may declare itself not capturable (e.g. external side effects that cannot be
  re-attached): ``task_data`` ``{"ng_checkpoint": "restart"}`` makes its session a restart.

A **retire** stops the retired attempts' requests in flight here first (``/verify``, tool calls:
every ``POST /ng-rollout/<key>/...``; each runs in a task of its own, ``ToolRequests``): it cancels
each once, a request not yet answering is refused 409 ``stale_attempt``, and the retire waits for
them to end before it drops the attempts' bindings and state and replies, so nothing of a retired
attempt replies from here after the retire did. A retried retire waits for them, never cancelling again.

Seeds are counted here (``status``: ``seed_session_calls`` and, for the most recent
rollouts, ``seed_sessions_by_rollout``), and so are tool calls attributed to a rollout
(``tool_calls_by_rollout``: every other ``POST /ng-rollout/<key>/<route>``), because a
controller cannot see whether a step or a tool call ran again after a restart; tests and
the demo read these counts.

The seed hook is called by the attachment's middleware (``_seeds.py``) once the server's
``/seed_session`` handler replied 2xx; the replies of ``/close_session`` end the tracking of
a session (``install_resources_declarations``, added in ``serving``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Mapping
from functools import partial
from typing import Any

from nemo_gym_checkpoint_plugin.builtin_participants.resources.checkpoint_modes import CheckpointMode, declared
from nemo_gym_checkpoint_plugin.builtin_participants.resources.session_state import (
    SessionState,
    UnsupportedSessionValue,
)
from nemo_gym_checkpoint_plugin.builtin_participants.resources.task_ids import task_id_from_wire, task_id_to_wire
from nemo_gym_checkpoint_plugin.builtin_participants.resources.tool_requests import (
    InFlightRequest,
    ToolRequests,
    count_rollout,
)
from nemo_gym_checkpoint_plugin.builtin_participants.shared.attempt_counts import AttemptCounts
from nemo_gym_checkpoint_plugin.builtin_participants.shared.attempts import RetiredBy
from nemo_gym_checkpoint_plugin.builtin_participants.shared.versions import Same

from nemo_gym_checkpoint_plugin._errors import ExportFailed
from nemo_gym_checkpoint_plugin._identity import EpisodeId, episode_to_wire, from_capture_key
from nemo_gym_checkpoint_plugin._markers import hookimpl
from nemo_gym_checkpoint_plugin._seeds import seeded_episode
from nemo_gym_checkpoint_plugin._types import (
    ParticipantExport,
    Readiness,
    RestoredRecord,
    SeedDeclaration,
    Versioned,
    plain_record,
)

logger = logging.getLogger(__name__)

__all__ = ["RESTART_TASK_KEY", "ResourcesSessions", "install_resources_declarations"]

RESTART_TASK_KEY = "ng_checkpoint"


def _stateless(server: Any) -> bool:
    from nemo_gym.base_resources_server import SimpleResourcesServer

    return type(server).seed_session is SimpleResourcesServer.seed_session


class ResourcesSessions:
    """Participant plugin of a Gym resources server (see the module docstring)."""

    def __init__(self, server: Any = None) -> None:
        self.server = server
        self.seed_calls = 0
        self.seeds_by_rollout: OrderedDict[str, int] = OrderedDict()
        self.tool_calls_by_rollout: OrderedDict[str, int] = OrderedDict()
        # Tool calls answered (2xx) per rollout and attempt, for the controller's lost-work ledger (the commit
        # reply's ``answered_tool_calls``); dropped when the rollout is forgotten or retired.
        self._answered_tools = AttemptCounts()
        self._restarts: set[str] = set()
        self._installed: dict[str, str] = {}  # replacement capture key -> resources_session_id
        self._installed_state: set[str] = set()  # replacement capture keys whose session state was installed
        # Requests in flight under /ng-rollout/<capture key>/..., by capture key (a retire stops them).
        self._in_flight: dict[str, set[InFlightRequest]] = {}
        self.instance: str | None = None
        if server is not None:
            self._bind(server)

    def _bind(self, server: Any) -> None:
        self.server = server
        table = getattr(server, "_session_episodes", None)
        self._table: dict[str, Any] | None = table if isinstance(table, dict) else None
        # Raises SettingsError (the server does not start) for a bad checkpoint_mode or checkpoint_session_state.
        self.mode, attrs = declared(server)
        self.session_state = SessionState(server, attrs) if attrs else None
        if self.mode is None:
            self.capturable = self._table is not None or _stateless(server)
        else:
            self.capturable = self.mode is not CheckpointMode.RESTART_ONLY
        self.verify_replay = self.mode is CheckpointMode.STATELESS
        self.restart_warning = None if self.capturable or self.mode is not None else _restart_warning(server)

    @hookimpl
    def attach(self, server: Any, kind: str, instance: str) -> bool:
        """Every resources server is one. Raises ``SettingsError`` for a bad ``checkpoint_mode``."""
        if kind != "resources":
            return False
        self._bind(server)
        self.instance = instance
        return True

    @hookimpl
    def serving(self, app: Any) -> None:
        install_resources_declarations(app, self)
        if self.restart_warning:
            # A server whose every episode is a restart says so once at startup (and in its status).
            logger.warning("checkpoint participant %s: %s", self.instance, self.restart_warning)

    # -- seeds and closes (from the middleware) ---------------------------------------------------

    @hookimpl
    def seed_session(self, episode_id: EpisodeId, session: Mapping[str, Any]) -> SeedDeclaration | None:
        self.seed_calls += 1
        rollout = episode_id.rollout_id
        count_rollout(self.seeds_by_rollout, rollout)
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
        self._installed_state.discard(episode_id.capture_key)
        if self.session_state is not None:
            # The episode is over here: its sessions are never exported again (the server keeps its own data).
            self.session_state.unbind(episode_id)

    def session_closed_elsewhere(self, session_id: str, episode_id: EpisodeId) -> None:
        """Another uvicorn worker of this server closed ``session_id`` of ``episode_id`` (``_workers``).

        The server's binding of it here is dropped (this worker never saw the close, so the server
        kept it), and the episode is over here as after a close this worker answered.
        """
        if self._table is not None and session_id in self._table:
            bound = self._table[session_id]
            if isinstance(bound, tuple) and bound and bound[0] == episode_id:
                del self._table[session_id]
        self.session_closed(episode_id)

    # -- participant hooks -------------------------------------------------------------------------

    @hookimpl
    def ready(self, checkpoint_id: str | None) -> Readiness:
        return Readiness(restarts=list(self._restarts))

    def tool_answered(self, episode: EpisodeId) -> None:
        """A tool call of ``episode`` replied 2xx (from the middleware)."""
        self._answered_tools.add(episode.rollout_id, episode.attempt)

    @hookimpl
    def forgotten(self, rollout_ids: list[str]) -> None:
        self._answered_tools.forget(rollout_ids)

    @hookimpl
    def export(self, checkpoint_id: str, scope: frozenset[str] | None) -> ParticipantExport:
        # Every episode's answered tool calls, restarts included (docs/protocol.md, the resources participant's
        # commit reply): the records below hold only the scope's.
        answered = self._answered_tools.by_key()
        return ParticipantExport(records=self._records(scope), reply_extras={"answered_tool_calls": answered})

    def _records(self, scope: frozenset[str] | None) -> list[Any]:
        """A binding alone is a ``Versioned`` record: versioned by the binding itself (``Same``: Gym binds a
        session with a new tuple, never changes one), so an unchanged binding is referred to, not written
        again. A record holding session state is plain: the server changes that state in place, through
        any request carrying the session's cookie, and no version here could follow it."""
        records: dict[str, Any] = {}
        for session_id, binding in (self._table or {}).items():
            episode_id, task_id = binding
            key = episode_id.capture_key
            if key in self._restarts or (scope is not None and key not in scope):
                continue
            wire = episode_to_wire(episode_id)
            records[key] = Versioned(wire, (session_id, Same(binding)), partial(_binding, wire, session_id, task_id))
        if self.session_state is not None:
            for key, session_ids in self.session_state.sessions_of(scope).items():
                if key in self._restarts:
                    continue
                try:
                    sessions = self.session_state.export_sessions(key, session_ids)
                except UnsupportedSessionValue as exc:
                    raise ExportFailed(f"{type(self.server).__name__}: {exc}") from None
                bound = records.get(key)
                record = (
                    plain_record(bound) if bound is not None else {"episode_id": episode_to_wire(from_capture_key(key))}
                )
                record["session_state"] = sessions
                records[key] = record
        return list(records.values())

    @hookimpl
    def install(self, checkpoint_id: str, manifest: Mapping[str, Any], records: list[RestoredRecord]) -> None:
        staged: dict[str, Any] = {}
        staged_state: list[tuple[EpisodeId, Any]] = []
        for restored in records:
            key = restored.checkpointed.capture_key
            record = restored.record
            if "resources_session_id" not in record and "session_state" not in record:
                raise ValueError(f"episode {key}: neither resources_session_id nor session_state")
            if "session_state" in record:
                if self.session_state is None:
                    raise ValueError(f"episode {key}: {type(self.server).__name__} names no session state")
                staged_state.append((restored.replacement, self.session_state.stage(key, record["session_state"])))
            if "resources_session_id" not in record:
                continue
            if self._table is None:
                raise ValueError(f"{type(self.server).__name__} keeps no session bindings; it cannot install any")
            session_id = record.get("resources_session_id")
            if not isinstance(session_id, str) or not session_id:
                raise ValueError(f"episode {key}: resources_session_id is missing")
            if session_id in self._table or session_id in staged:
                raise ValueError(f"episode {key}: session {session_id} already exists")
            staged[session_id] = (restored.replacement, task_id_from_wire(record.get("task_id")))
        if staged_state:
            staged_ids = [session_id for _episode, sessions in staged_state for session_id, _values in sessions]
            if len(set(staged_ids)) != len(staged_ids):
                raise ValueError("two restored episodes name the same session")
        # Everything validated: nothing below raises, so a refused install leaves nothing installed.
        if self._table is not None:
            self._table.update(staged)
        for session_id, (episode_id, _task) in staged.items():
            self._installed[episode_id.capture_key] = session_id
        for replacement, sessions in staged_state:
            assert self.session_state is not None
            self.session_state.apply(replacement, sessions)
            self._installed_state.add(replacement.capture_key)

    @hookimpl
    def restored_pending(self) -> list[str]:
        return sorted(set(self._installed) | self._installed_state)

    @hookimpl
    def delete_restored(self, episode_ids: list[EpisodeId]) -> None:
        for episode_id in episode_ids:
            session_id = self._installed.pop(episode_id.capture_key, None)
            if session_id is not None and self._table is not None:
                self._table.pop(session_id, None)
        keys = {episode_id.capture_key for episode_id in episode_ids}
        self._installed_state -= keys
        if self.session_state is not None:
            self.session_state.drop(lambda episode: episode.capture_key in keys)

    def request_began(self, key: str, task: asyncio.Task[Any]) -> InFlightRequest:
        request = InFlightRequest(task)
        self._in_flight.setdefault(key, set()).add(request)
        return request

    def request_ended(self, key: str, request: InFlightRequest) -> None:
        requests = self._in_flight.get(key)
        if requests is not None:
            requests.discard(request)
            if not requests:
                del self._in_flight[key]

    @hookimpl
    async def retire(self, episode_ids: list[EpisodeId]) -> None:
        named = RetiredBy(episode_ids)
        # First stop the attempts' requests in flight (each cancelled once), so none replies after the retire
        # and none reads what is dropped below while it runs.
        stopping: list[asyncio.Task[Any]] = []
        for key, requests in self._in_flight.items():
            if named.key(key):
                for request in requests:
                    if not request.retired:
                        request.retired = True
                        request.task.cancel()
                    stopping.append(request.task)
        if stopping:
            await asyncio.wait(stopping)
        self._answered_tools.retire(episode_ids)
        for key in [k for k in self._restarts if named.key(k)]:
            self._restarts.discard(key)
        self._installed_state = {k for k in self._installed_state if not named.key(k)}
        if self.session_state is not None:
            self.session_state.drop(named)
        for key in [k for k in self._installed if named.key(k)]:
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
            "session_state": list(self.session_state.attrs) if self.session_state is not None else [],
            "seed_sessions_by_rollout": dict(self.seeds_by_rollout),
            "tool_calls_by_rollout": dict(self.tool_calls_by_rollout),
            "restart_warning": self.restart_warning,
        }


def _binding(episode: dict[str, Any], session_id: str, task_id: Any) -> dict[str, Any]:
    return {"episode_id": episode, "resources_session_id": session_id, "task_id": task_id_to_wire(task_id)}


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


def install_resources_declarations(app: Any, sessions: ResourcesSessions) -> None:
    """Count tool calls, bind session state, track closes (the ``seed_session`` hook is the wiring's: ``_seeds``)."""
    from nemo_gym_checkpoint_plugin.builtin_participants.shared.reply_headers import ReplyHeaders

    async def on_close(body: bytes, status: int) -> dict[str, str]:
        found = seeded_episode(body) if 200 <= status < 300 else None
        if found is not None:
            sessions.session_closed(found[0])
        return {}

    app.add_middleware(ToolRequests, sessions=sessions)
    if sessions.session_state is not None:
        from nemo_gym_checkpoint_plugin.builtin_participants.resources.session_state import install_session_binder

        install_session_binder(app, sessions.session_state)
    app.add_middleware(ReplyHeaders, path="/close_session", headers_for=on_close)
