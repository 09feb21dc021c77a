"""The agent participant for Gym's session agents (``simple_agent``): open sessions survive a crash.

What ``simple_agent`` must keep for a restored episode to reuse its session: its open
session records (``SimpleResponsesAPIAgent._session_records``) live in process memory
and are lost on SIGKILL, after which the episode's next ``/v1/responses`` is refused
(409 unknown session). A session's state is small and plain: the seed request (tool
accesses, episode), the resources cookies it collected, its activation count and
observations. So this participant exports, per episode in scope, each *open* session
(``{"episode_id", "agent_session_id", "request", "resources_cookies", "activations",
"observations"}``; ``observations`` only when there are any, and the request's fields left at their
None default are left out: a record line without ``null`` is not walked for NaN by the writer) and
installs it as the replacement attempt's session:

- the seed request's ``episode_id`` becomes the replacement attempt, so the
  environment's close (which names the replacement) matches;
- a direct tool access whose ``base_url`` ends in ``/ng-rollout/<checkpointed key>``
  (the plugin's client attributes tool calls that way) is rewritten to the replacement's
  key: the checkpointed attempt is retired everywhere and would be refused;
- the session's state is rebuilt by the agent's own ``_seed_agent_session_state`` (so
  tool access objects are the agent's own), then its cookies, activations and
  observations are put back.

Closed sessions (an episode past its agent step) are not exported: their close receipts
only serve retries of a close that already happened.

Each record is an ``api.Versioned``: a checkpoint written beside this server's previous one refers
to a session's previous record while nothing it is made of changed (``export``: Gym replaces the
objects it changes, so the version is made of those objects and the turn's ``changes``).

With the wrapper's ``SimpleAgentTurns`` (``turn_loop.py``; mid-turn boundaries) each
record also carries ``"turn"``: the session's turn so far (``turn_journal.Turn``: the model answers
and tool results completed, in order), so a restored turn continues without resending them; the
seed reply then declares ``mid-turn`` instead of ``capture``.

Session cookies stay valid across the restart: Gym signs them with a key derived from
the class and server names, which the wrapper keeps. ``/v1/agent_sessions`` replies carry
``x-ng-checkpoint-agent-session: capture`` (``install_agent_declaration``), which is how
the environment tells a capturable agent from one whose episodes must be restarts.

An agent's own ``/run`` (the legacy route where the agent owns the whole episode) is
not a session: no participant can capture it, so every agent also gets
``UncapturedRuns`` (``shared/uncaptured_runs.py``), which lists those episodes as restarts and
refuses a ``/run`` naming no rollout with ``rollout_id_required``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import orjson
from nemo_gym_checkpoint_plugin.builtin_participants.agent.session_record import session_record as build_record
from nemo_gym_checkpoint_plugin.builtin_participants.agent.turn_journal import Turn, TurnBook
from nemo_gym_checkpoint_plugin.builtin_participants.shared.attempts import RetiredBy
from nemo_gym_checkpoint_plugin.builtin_participants.shared.versions import Same

from nemo_gym_checkpoint_plugin._gc_pause import gc_paused
from nemo_gym_checkpoint_plugin._identity import EpisodeId, capture_key, episode_to_wire
from nemo_gym_checkpoint_plugin._markers import hookimpl
from nemo_gym_checkpoint_plugin._types import Readiness, RestoredRecord, Versioned
from nemo_gym_checkpoint_plugin._wire import (
    AGENT_SESSION_CAPTURE,
    AGENT_SESSION_HEADER,
    AGENT_SESSION_MID_TURN,
    ROLLOUT_PATH_PREFIX,
)

__all__ = ["SimpleAgentSessions", "is_session_agent", "rewrite_rollout_base", "install_agent_declaration"]

_ROLLOUT_SEGMENT = ROLLOUT_PATH_PREFIX
# Seed-request dumps kept beyond twice the open sessions at the last prune are pruned (never below this).
_PRUNE_FLOOR = 1024


def is_session_agent(server: Any) -> bool:
    """Whether ``server`` keeps Gym agent sessions this participant knows how to capture."""
    from nemo_gym.base_responses_api_agent import SimpleResponsesAPIAgent

    if not isinstance(server, SimpleResponsesAPIAgent):
        return False
    # Only agents whose session state is Simple Agent's: its fields are what this module restores.
    return any(cls.__name__ == "SimpleAgent" for cls in type(server).__mro__)


def rewrite_rollout_base(url: str, old_key: str, new_key: str) -> str:
    """``url`` with a trailing ``/ng-rollout/<old_key>`` replaced by the new key (else unchanged)."""
    return _rebased(url, _ROLLOUT_SEGMENT + old_key, _ROLLOUT_SEGMENT + new_key)


_NONE_DEFAULTS: dict[type, tuple[str, ...]] = {}


def _none_defaults(model: type) -> tuple[str, ...]:
    """The fields of a pydantic ``model`` that are optional with the default None (leaving one out means None)."""
    names = _NONE_DEFAULTS.get(model)
    if names is None:
        fields = getattr(model, "model_fields", {})
        names = tuple(n for n, f in fields.items() if not f.is_required() and f.default is None and not f.alias)
        _NONE_DEFAULTS[model] = names
    return names


def _rebased(url: str, old_suffix: str, new_suffix: str) -> str:
    """``rewrite_rollout_base`` with both ``/ng-rollout/<key>`` suffixes made (once per record, not per access)."""
    stripped = url.rstrip("/")
    if stripped.endswith(old_suffix):
        return stripped[: -len(old_suffix)] + new_suffix
    return url


class SimpleAgentSessions:
    """Export and install the open sessions of a Simple Agent, keyed by their episode attempt.

    With ``turns`` (the server runs ``SimpleAgentTurns``: mid-turn boundaries) each session's
    record also holds its turn so far, and this plugin answers the agent's readiness (a call
    whose effect is not recorded yet blocks), parks turns while admission is closed, and
    cancels the running turns of the attempts a retire names.
    """

    def __init__(self, server: Any = None, turns: TurnBook | None = None) -> None:
        self.server = server
        self.turns = turns
        self._installed: set[str] = set()
        # Session id -> (its seed request, that request's JSON dump): a session's seed request is not
        # changed once seeded, so each is dumped once; a request replaced by another is dumped again.
        self._dumps: dict[str, tuple[Any, dict[str, Any]]] = {}
        self._prune_at = _PRUNE_FLOOR

    @hookimpl
    def attach(self, server: Any, kind: str) -> bool:
        """A Simple Agent's sessions (with each turn so far when it runs Simple Agent's own turn loop)."""
        if kind != "agent" or not is_session_agent(server):
            return False
        self.server, self.turns = server, _turn_book(server)
        return True

    @hookimpl
    def serving(self, app: Any) -> None:
        install_agent_declaration(app, mid_turn=self.turns is not None, sessions=self)

    def _records(self) -> dict[str, Any]:
        # A pydantic private attribute (each read costs microseconds): hooks read it once.
        return self.server._session_records

    def _request_dump(self, session_id: str, request: Any) -> dict[str, Any]:
        cached = self._dumps.get(session_id)
        if cached is not None and cached[0] is request:
            return cached[1]
        dump = request.model_dump(mode="json")
        # A field left at its None default is left out: the record's line then holds no ``null`` and the
        # writer's NaN walk (codec.py: only lines holding ``null`` are walked) is not run for it; the
        # install's validation puts the same default back.
        for name in _none_defaults(type(request)):
            if name in dump and dump[name] is None:
                del dump[name]
        self._dumps[session_id] = (request, dump)
        return dump

    def remember_seed(self, session_id: str) -> None:
        """A session was just seeded (its seed reply is starting): dump its request now, not in a checkpoint."""
        sessions = self._records()
        record = sessions.get(session_id)
        state = record.state if record is not None else None
        if state is not None:
            self._request_dump(session_id, state.request)
        if len(self._dumps) > self._prune_at:
            self._prune_dumps(sessions)

    def _prune_dumps(self, sessions: dict[str, Any]) -> None:
        """Forget the dumps of sessions closed or gone (and of requests replaced since)."""
        kept = {}
        for session_id, (request, dump) in self._dumps.items():
            record = sessions.get(session_id)
            if record is not None and record.state is not None and record.state.request is request:
                kept[session_id] = (request, dump)
        self._dumps = kept
        self._prune_at = max(_PRUNE_FLOOR, 2 * len(kept))

    @hookimpl
    def export(self, checkpoint_id: str, scope: frozenset[str] | None) -> list[Versioned]:
        """Each open session's record as a ``Versioned``, built (in the writer's thread) only when it changed.

        Gym's session state is Gym's: this participant sees no write to it. Every change Gym (and the
        turn loop) makes replaces an attribute's object (the state at a seed, ``observations``,
        ``resources_cookies``) or an ``int`` (``activations``), so the version is made of those:
        ``Same`` of each object, the values of the int and of the cookies, and the turn's ``changes``
        (turn_journal.Turn). The parts the record is built from are taken now, as the record was.
        """
        sessions = self._records()
        turns = self.turns.turns if self.turns is not None else None
        records = []
        for session_id, record in sessions.items():
            state = record.state
            episode_id = record.episode_id
            if state is None or record.closing or episode_id is None:
                continue
            if scope is not None and episode_id.capture_key not in scope:
                continue
            observations = getattr(state, "observations", None)
            cookies = dict(getattr(state, "resources_cookies", {}) or {})
            activations = int(getattr(state, "activations", 0))
            turn = turns.get(session_id) if turns is not None else None
            calls = list(turn.calls) if turn is not None else None
            version = (
                session_id,
                Same(state),
                Same(state.request),
                activations,
                tuple(cookies.items()),
                Same(observations),
                Same(turn),
                turn.changes if turn is not None else None,
            )
            wire = episode_to_wire(episode_id)
            # Shared with later exports (never mutated: records are only read once exported).
            request = self._request_dump(session_id, state.request)
            build = partial(build_record, wire, session_id, request, cookies, activations, observations, turn, calls)
            records.append(Versioned(wire, version, build))
        self._prune_dumps(sessions)
        return records

    @hookimpl
    async def install(self, checkpoint_id: str, manifest: Mapping[str, Any], records: list[RestoredRecord]) -> None:
        sessions = self._records()
        with gc_paused():  # thousands of sessions built at once (_gc_pause.py)
            staged = await self._stage(records, sessions)
        # Every record was accepted: only now does any session appear.
        for session_id, (session_record, key, turn) in staged.items():
            sessions[session_id] = session_record
            self._installed.add(key)
            if turn is not None and self.turns is not None:
                self.turns.turns[session_id] = turn

    async def _stage(self, records: list[RestoredRecord], sessions: dict[str, Any]) -> dict[str, Any]:
        """Each record's session, built and checked (``ValueError`` naming the episode); nothing installed yet."""
        from nemo_gym.base_responses_api_agent import AgentSeedSessionRequest, _AgentSessionRecord
        from nemo_gym.rollout_observability import AgentObservationBundle

        staged: dict[str, Any] = {}
        seed_state = self.server._seed_agent_session_state
        validate = AgentSeedSessionRequest.model_validate
        for restored in records:
            record = restored.record
            checkpointed, replacement = restored.checkpointed, restored.replacement
            # Each key made once (Gym's property is a Python call per read): the same rule, capture_key().
            old_key = capture_key(checkpointed.rollout_id, checkpointed.attempt)
            new_key = capture_key(replacement.rollout_id, replacement.attempt)
            session_id = record.get("agent_session_id")
            if not isinstance(session_id, str) or not session_id:
                raise ValueError(f"episode {old_key}: agent_session_id must be a non-empty string")
            if session_id in sessions or session_id in staged:
                raise ValueError(f"episode {old_key}: agent session {session_id} already exists here")
            request = dict(record.get("request") or {})
            # The replacement's EpisodeId itself (validated when it was built; pydantic keeps an instance).
            request["episode_id"] = replacement
            old_suffix, new_suffix = _ROLLOUT_SEGMENT + old_key, _ROLLOUT_SEGMENT + new_key
            request["tool_accesses"] = [
                {**access, "base_url": _rebased(str(access["base_url"]), old_suffix, new_suffix)}
                # Decoded records are plain dicts: the exact type test first (an ABC check costs more).
                if (type(access) is dict or isinstance(access, Mapping)) and "base_url" in access
                else access
                for access in request.get("tool_accesses") or []
            ]
            seed = validate(request)
            state = await seed_state(seed)
            cookies = record.get("resources_cookies") or {}
            if type(cookies) is not dict and not isinstance(cookies, Mapping):
                raise ValueError(f"episode {old_key}: resources_cookies must be a JSON object")
            state.resources_cookies = {str(k): str(v) for k, v in cookies.items()}
            state.activations = int(record.get("activations") or 0)
            if record.get("observations") is not None:
                state.observations = AgentObservationBundle.model_validate(record["observations"])
            turn = None
            if self.turns is not None and record.get("turn") is not None:
                try:
                    turn = Turn.from_wire(record["turn"])
                except ValueError as exc:
                    raise ValueError(f"episode {old_key}: {exc}") from None
            staged[session_id] = (_AgentSessionRecord(state=state, episode_id=replacement), new_key, turn)
        return staged

    @hookimpl
    def restored_pending(self) -> list[str]:
        if not self._installed:
            return []
        pending = set()
        for record in self._records().values():
            episode_id = record.episode_id
            if episode_id is not None and record.state is not None and not record.closing:
                key = episode_id.capture_key
                if key in self._installed:
                    pending.add(key)
        self._installed &= pending
        return sorted(pending)

    def _drop(self, named: Callable[[EpisodeId, str], bool]) -> None:
        """Remove the sessions (with state) whose attempt ``named(episode_id, capture_key)`` names."""
        sessions = self._records()
        turns = self.turns.turns if self.turns is not None else None
        for session_id, record in list(sessions.items()):
            episode_id = record.episode_id
            if episode_id is None or record.state is None:
                continue
            key = episode_id.capture_key
            if named(episode_id, key):
                del sessions[session_id]
                self._dumps.pop(session_id, None)
                self._installed.discard(key)
                if turns is not None:
                    turns.pop(session_id, None)

    @hookimpl
    def delete_restored(self, episode_ids: list[EpisodeId]) -> None:
        keys = {episode_id.capture_key for episode_id in episode_ids} & self._installed
        if keys:
            self._drop(lambda _episode_id, key: key in keys and key in self._installed)

    @hookimpl
    async def retire(self, episode_ids: list[EpisodeId]) -> None:
        named = RetiredBy(episode_ids)
        if self.turns is not None:
            # The attempts' turns still running (their environment is gone) stop before their sessions go.
            await self.turns.stop(named.key)
        # The environment closes sessions of episodes it stops; what is left (restored, never used) goes here.
        self._drop(lambda episode_id, _key: named(episode_id))

    # -- mid-turn boundaries (only with turns) -------------------------------------------------------

    @hookimpl
    def close_admission(self, checkpoint_id: str) -> None:
        if self.turns is not None:
            self.turns.close()

    @hookimpl
    def open_admission(self, checkpoint_id: str) -> None:
        if self.turns is not None:
            self.turns.open()

    @hookimpl
    def ready(self, checkpoint_id: str | None) -> Readiness | None:
        if self.turns is None:
            return None
        counts = {"turns_running": self.turns.running(), "turns_parked": self.turns.parked}
        return Readiness(blockers=self.turns.blockers(), restarts=[], counts=counts)

    @hookimpl
    def wait_ready(self, checkpoint_id: str) -> Any:
        return self.turns.wait_change() if self.turns is not None else None

    @hookimpl
    def status_fields(self) -> dict[str, Any]:
        open_sessions = sum(1 for r in self._records().values() if r.state is not None and not r.closing)
        fields: dict[str, Any] = {"agent_sessions_open": open_sessions}
        if self.turns is not None:
            fields["agent_mid_turn"] = True
        return fields


def _turn_book(server: Any) -> TurnBook | None:
    """A bound ``TurnBook`` when ``server`` runs Simple Agent's own turn loop under the mixin, else None."""
    from nemo_gym_checkpoint_plugin.builtin_participants.agent.turn_loop import captures_mid_turn

    if not captures_mid_turn(server):
        return None
    book = TurnBook(model_server=server.config.model_server.name)
    server.bind_turn_book(book)
    return book


def install_agent_declaration(app: Any, *, mid_turn: bool = False, sessions: SimpleAgentSessions | None = None) -> None:
    """Add ``x-ng-checkpoint-agent-session: capture`` (``mid-turn`` with turns) to every successful seed reply.

    With ``sessions``, each successful seed also has its request dumped there (``remember_seed``), so an
    export finds it done: a checkpoint holds every rollout still, a seed does not.
    """
    from nemo_gym_checkpoint_plugin.builtin_participants.shared.reply_headers import ReplyHeaders

    value = AGENT_SESSION_MID_TURN if mid_turn else AGENT_SESSION_CAPTURE

    async def declare(body: bytes, status: int) -> dict[str, str]:
        if not 200 <= status < 300:
            return {}
        if sessions is not None:
            try:
                seeded = orjson.loads(body)
            except ValueError:
                seeded = None  # a body only Gym's own parser reads: its first export dumps it instead
            session_id = seeded.get("agent_session_id") if isinstance(seeded, dict) else None
            if isinstance(session_id, str):
                sessions.remember_seed(session_id)
        return {AGENT_SESSION_HEADER: value}

    app.add_middleware(ReplyHeaders, path="/v1/agent_sessions", headers_for=declare)
