"""Session state without code: a resources server's per-session dict attributes, exported and installed.

Many Gym resources servers keep their per-session state in dict attributes keyed by Gym's
session id (the ``session_id`` of the signed session cookie: ``request.session[SESSION_ID_KEY]``),
e.g. ``example_session_state_mgmt``'s ``session_id_to_counter`` or a ``GymnasiumServer``'s
``session_state``. A server that names such attributes (``checkpoint_session_state`` in its
config, or the built-in table of ``checkpoint_modes.py``) gets them checkpointed by the built-in
resources participant, with no plugin of its own:

- **Which episode a session belongs to.** ``SessionBinder``, the innermost middleware of the
  app (inside Gym's session and rollout-context middlewares), reads each request's session id
  and its episode: the rollout context Gym's ``RolloutContextMiddleware`` set from the
  ``/ng-rollout/<capture key>`` prefix (the plugin's client adds it to every call made inside a
  rollout, tool calls included), else, for ``/seed_session``, the body's ``episode_id``. A
  session stays bound to its episode; a later attempt of the same rollout (a restored
  episode keeps its cookie) takes it over.
- **Export.** For every bound session of an episode in scope, the value of each named
  attribute under that session id is encoded (``encode``): JSON values as they are; a
  pydantic model as its class and ``model_dump(mode="json")``; a ``random.Random`` as its
  state (so a restored game draws the same numbers). A model that does not come back equal
  through ``model_dump``/``model_validate`` (an excluded field, a private attribute set) and
  anything else fail the commit
  (``export_failed``) naming the episode, the attribute and the type: state is never
  silently dropped.
- **Install.** The values are decoded (a pydantic model validated again as the **same** model
  class, which must already be loaded in the server process: a checkpoint never makes a
  server import a module) and written back under the same session id, bound to the
  replacement attempt; the environment's restored episode carries the same cookie, so the
  server finds its state where it left it.

A value tagged ``{"$ng": ...}`` is one of ours; a plain dict that happens to have a ``"$ng"``
key is escaped as ``{"$ng": "dict", "items": {...}}``, so any JSON round-trips.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from nemo_gym_checkpoint_plugin._asgi import Receive, Scope, Send, buffer_body
from nemo_gym_checkpoint_plugin._identity import EpisodeId, from_capture_key

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = ["SessionBinder", "SessionState", "UnsupportedSessionValue", "decode", "encode", "install_session_binder"]

_TAG = "$ng"
_SESSION_ID_KEY = "session_id"  # nemo_gym.server_utils.SESSION_ID_KEY (read once here, not imported per request)


class UnsupportedSessionValue(TypeError):
    """A session value that is neither JSON nor a pydantic model (nor a ``random.Random``)."""


def encode(value: Any, where: str = "value") -> Any:
    """``value`` as JSON, tagged where JSON alone would not restore it; ``UnsupportedSessionValue`` naming ``where``."""
    from pydantic import BaseModel

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [encode(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise UnsupportedSessionValue(f"{where} has a key {key!r} of type {type(key).__name__}, not str")
        items = {key: encode(item, f"{where}[{key!r}]") for key, item in value.items()}
        return {_TAG: "dict", "items": items} if _TAG in value else items
    if isinstance(value, BaseModel):
        cls = type(value)
        try:
            # By alias: what model_validate reads back whatever the model's populate_by_name says.
            data = value.model_dump(mode="json", by_alias=True)
            same = cls.model_validate(data) == value
        except Exception as exc:  # a field pydantic cannot render as JSON: refused, never half-saved
            raise UnsupportedSessionValue(f"{where}: {cls.__qualname__} does not dump as JSON ({exc})") from None
        if not same:
            # An excluded field, a private attribute set, a lossy serializer: restoring it would lose state.
            raise UnsupportedSessionValue(f"{where}: {cls.__qualname__} does not survive model_dump/model_validate")
        return {_TAG: "model", "class": f"{cls.__module__}:{cls.__qualname__}", "data": data}
    if type(value) is random.Random:
        version, internal, gauss_next = value.getstate()
        return {_TAG: "random", "state": [version, list(internal), gauss_next]}
    raise UnsupportedSessionValue(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}: "
        "only JSON values, pydantic models and random.Random are checkpointed"
    )


def _model_class(name: Any) -> type[BaseModel]:
    from pydantic import BaseModel

    module_name, _, qualname = str(name).partition(":")
    module = sys.modules.get(module_name)  # loaded by the server already: a record never imports code
    target: Any = module
    for part in qualname.split(".") if module is not None and qualname else ():
        target = getattr(target, part, None)
    if not (isinstance(target, type) and issubclass(target, BaseModel)):
        raise ValueError(f"model class {name!r} is not a pydantic model loaded in this server")
    return target


def decode(value: Any) -> Any:
    """The inverse of ``encode``; ``ValueError`` for a tag it does not know or a value that does not validate."""
    if isinstance(value, list):
        return [decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {key: decode(item) for key, item in value.items()}
    if tag == "dict" and isinstance(value.get("items"), dict):
        return {key: decode(item) for key, item in value["items"].items()}
    if tag == "model":
        return _model_class(value.get("class")).model_validate(value.get("data"))
    if tag == "random":
        state = value.get("state")
        rng = random.Random()
        try:
            version, internal, gauss_next = state  # type: ignore[misc]
            rng.setstate((version, tuple(internal), gauss_next))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"a random.Random state that does not restore: {exc}") from None
        return rng
    raise ValueError(f"unknown session value tag {tag!r}")


class SessionState:
    """The named dict attributes of one server, bound per session id to the episode that owns the session."""

    def __init__(self, server: Any, attrs: Iterable[str]) -> None:
        self.attrs = tuple(attrs)
        self.tables: dict[str, dict[str, Any]] = {attr: getattr(server, attr) for attr in self.attrs}
        self.bindings: dict[str, EpisodeId] = {}  # session id -> the episode (attempt) that owns it
        # The other way (episode -> its session ids): a close unbinds its episode without scanning every binding.
        self._sessions: dict[EpisodeId, set[str]] = {}

    def bind(self, session_id: str, episode: EpisodeId) -> None:
        current = self.bindings.get(session_id)
        # A later attempt of the same rollout (a restored episode reusing its cookie) takes the session over.
        if current is None or (current.rollout_id == episode.rollout_id and current.attempt < episode.attempt):
            self._set(session_id, episode)

    def _set(self, session_id: str, episode: EpisodeId) -> None:
        self._forget(session_id)
        self.bindings[session_id] = episode
        self._sessions.setdefault(episode, set()).add(session_id)

    def _forget(self, session_id: str) -> None:
        episode = self.bindings.pop(session_id, None)
        if episode is not None:
            sessions = self._sessions.get(episode)
            if sessions is not None:
                sessions.discard(session_id)
                if not sessions:
                    del self._sessions[episode]

    def sessions_of(self, keys: frozenset[str] | None) -> dict[str, list[str]]:
        """``{capture key: [session id, ...]}`` of bound sessions holding state, for episodes in ``keys``."""
        found: dict[str, list[str]] = {}
        for session_id, episode in list(self.bindings.items()):
            if not any(session_id in table for table in self.tables.values()):
                continue
            key = episode.capture_key
            if keys is None or key in keys:
                found.setdefault(key, []).append(session_id)
        return found

    def export_sessions(self, key: str, session_ids: list[str]) -> list[dict[str, Any]]:
        """The ``session_state`` field of ``key``'s record; ``UnsupportedSessionValue`` naming the episode."""
        out = []
        for session_id in sorted(session_ids):
            values = {}
            for attr, table in self.tables.items():
                if session_id in table:
                    try:
                        values[attr] = encode(table[session_id], f"{attr}[{session_id!r}]")
                    except UnsupportedSessionValue as exc:
                        raise UnsupportedSessionValue(f"episode {key}: session state {exc}") from None
            out.append({"session_id": session_id, "values": values})
        return out

    def stage(self, key: str, sessions: Any) -> list[tuple[str, dict[str, Any]]]:
        """Decode a record's ``session_state`` (nothing written yet); ``ValueError`` naming the episode."""
        if not isinstance(sessions, list):
            raise ValueError(f"episode {key}: session_state is not a list")
        staged = []
        for entry in sessions:
            session_id = entry.get("session_id") if isinstance(entry, Mapping) else None
            values = entry.get("values") if isinstance(entry, Mapping) else None
            if not isinstance(session_id, str) or not session_id or not isinstance(values, Mapping):
                raise ValueError(f"episode {key}: a session_state entry without session_id and values")
            unknown = set(values) - set(self.tables)
            if unknown:
                raise ValueError(
                    f"episode {key}: session state of attributes this server does not name: {sorted(unknown)}"
                )
            if session_id in self.bindings or any(session_id in table for table in self.tables.values()):
                raise ValueError(f"episode {key}: session {session_id} already exists")
            try:
                decoded = {attr: decode(value) for attr, value in values.items()}
            except Exception as exc:
                raise ValueError(f"episode {key}: session {session_id}: {exc}") from None
            staged.append((session_id, decoded))
        return staged

    def apply(self, replacement: EpisodeId, staged: list[tuple[str, dict[str, Any]]]) -> None:
        for session_id, values in staged:
            for attr, value in values.items():
                self.tables[attr][session_id] = value
            self._set(session_id, replacement)

    def drop(self, named: Any) -> None:
        """Forget every session bound to an episode ``named(episode)`` says, and its state."""
        for session_id in [s for s, episode in self.bindings.items() if named(episode)]:
            self._forget(session_id)
            for table in self.tables.values():
                table.pop(session_id, None)

    def unbind(self, episode: EpisodeId) -> None:
        """Forget the bindings of ``episode``'s sessions (its close), leaving the server's own data alone."""
        for session_id in list(self._sessions.get(episode, ())):
            self._forget(session_id)


class SessionBinder:
    """Innermost ASGI middleware: bind each request's session id to its episode (see the module docstring)."""

    def __init__(self, app: Any, *, state: SessionState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            session = scope.get("session")
            session_id = session.get(_SESSION_ID_KEY) if isinstance(session, dict) else None
            if isinstance(session_id, str) and session_id:
                episode = _context_episode()
                if episode is None and scope.get("path") == "/seed_session":
                    body, receive = await buffer_body(receive)
                    episode = _body_episode(body)
                if episode is not None:
                    self.state.bind(session_id, episode)
        await self.app(scope, receive, send)


def _context_episode() -> EpisodeId | None:
    from nemo_gym.rollout_correlation import current_rollout_id

    key = current_rollout_id()
    if not key:
        return None
    try:
        return from_capture_key(key)
    except ValueError:
        return None


def _body_episode(body: bytes) -> EpisodeId | None:
    from nemo_gym_checkpoint_plugin._seeds import seeded_episode

    found = seeded_episode(body)
    return found[0] if found is not None else None


def install_session_binder(app: Any, state: SessionState) -> None:
    """Add ``SessionBinder`` innermost (after Gym's session middleware has set the session id)."""
    from starlette.middleware import Middleware

    app.user_middleware.append(Middleware(SessionBinder, state=state))
