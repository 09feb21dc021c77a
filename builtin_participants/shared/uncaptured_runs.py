"""Episodes no participant can capture: listed as restarts, never silently absent (docs/protocol.md "Restarts").

Two kinds of ``/run`` start an episode that runs inside one request coroutine, with
nothing of it reachable at a step boundary:

- an **agent's** ``/run`` (``simple_agent`` and every other Gym agent): the agent owns
  the whole episode (seed, model and tool calls, verify) in that coroutine. Episodes
  an environment runs through agent *sessions* (``/v1/agent_sessions`` then
  ``/v1/responses``, as ``single_agent_turn`` does) never use it; a ``/run`` reaches an
  agent only from Gym's rollout collection calling the agent directly, or through the
  ``legacy_agent`` relay (which lists the episode as a restart too);
- an **environment's** ``/run`` when the plugin has no steps for its run logic (no
  built-in participant: not ``single_agent_turn``, not the ``legacy_agent`` relay).

What attributes such a ``/run``: its JSON body, read as the gate reads it
(``_gate.episode_of_run_body``): an ``episode_id`` object, or, for the legacy rows an
agent's ``/run`` takes, the capture key Gym derives from ``_ng_rollout_id`` or
``_ng_task_index``/``_ng_rollout_index`` (plus ``_ng_attempt_index``). ``RunTracker``,
a pure ASGI middleware inside the gate (installed only on those servers; other paths
cost one string comparison), then:

- refuses a JSON object that names no episode with 400 ``rollout_id_required`` (agent
  work the controller could never name, retire or restart); a body that is not a JSON
  object at all goes to the route, whose validation answers;
- registers the episode while its ``/run`` runs: ``ready`` lists it in ``restarts``
  (never blocking, never exported: this participant exports nothing);
- refuses a retired attempt (the marks ``serving`` hands it) with ``stale_attempt``, and
  a second ``/run`` of an attempt already running with ``attempt_running`` (it lives elsewhere);
- ``retire`` cancels the named attempts' requests (and earlier ones) once and waits for
  them; a request it stopped answers 409 ``stale_attempt`` if it had not started its
  reply. A retried retire waits for what an earlier one cancelled, never cancels again.

A ``/run`` that passed the gate just before a checkpoint closed admission waits here,
unregistered and not started (like a request parked at the gate), until admission
reopens: the restarts a prepare reported cannot change before its commit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from nemo_gym_checkpoint_plugin.builtin_participants.shared.attempts import stopping_until_done

from nemo_gym_checkpoint_plugin._admission import RetiredMarks
from nemo_gym_checkpoint_plugin._asgi import Message, Send, buffer_body
from nemo_gym_checkpoint_plugin._errors import AttemptRunning, CheckpointError, RolloutIdRequired, StaleAttempt
from nemo_gym_checkpoint_plugin._gate import episode_of_run_body, json_as_gym_reads
from nemo_gym_checkpoint_plugin._identity import EpisodeId, from_capture_key
from nemo_gym_checkpoint_plugin._markers import hookimpl
from nemo_gym_checkpoint_plugin._types import Readiness

__all__ = ["RunTracker", "UncapturedRuns", "install_run_tracker", "names_no_episode", "rollout_id_required"]

logger = logging.getLogger(__name__)


class UncapturedRuns:
    """Participant plugin: the ``/run`` episodes of this server, each a restart (see the module docstring).

    Joins through ``attach`` every agent and every environment whose run logic no built-in
    participant reports steps for (the ``single_agent_turn`` steps, the ``legacy_agent`` relay).
    """

    def __init__(self, kind: str = "", restart_warning: str | None = None) -> None:
        self.kind = kind
        self.instance: str | None = None
        # Set for an environment: every episode it runs is a restart (logged at startup, shown in status).
        self.restart_warning = restart_warning
        self._running: dict[str, asyncio.Task[Any]] = {}
        # Tasks a retire cancelled, by capture key, until done: a retried retire awaits them.
        self._stopping: dict[str, asyncio.Task[Any]] = {}
        self._marks: RetiredMarks | None = None
        self._open = asyncio.Event()
        self._open.set()

    @hookimpl
    def attach(self, server: Any, kind: str, instance: str) -> bool:
        if kind == "environment":
            from nemo_gym_checkpoint_plugin.builtin_participants.environment.relay import LegacyAgentRelay
            from nemo_gym_checkpoint_plugin.builtin_participants.environment.steps import SingleAgentTurnSteps

            if isinstance(server, SingleAgentTurnSteps | LegacyAgentRelay):
                return False  # its episodes have a participant of their own
            # No steps for this run logic: its episodes are listed as restarts, never silently lost.
            self.restart_warning = _environment_warning(server)
        elif kind != "agent":
            return False
        # An agent's /run owns its whole episode: never capturable, always a restart.
        self.kind, self.instance = kind, instance
        return True

    @hookimpl
    def serving(self, app: Any, marks: RetiredMarks) -> None:
        self._marks = marks
        install_run_tracker(app, self)
        if self.restart_warning:
            # A server whose every episode is a restart says so once at startup (and in its status).
            logger.warning("checkpoint participant %s: %s", self.instance, self.restart_warning)

    def refusal(self, episode_id: EpisodeId) -> CheckpointError | None:
        """Why this attempt may not start here now (retired, or already running), else None."""
        marks = self._marks
        if marks is not None and marks.is_retired(episode_id.rollout_id, episode_id.attempt):
            return _stale(episode_id)
        if episode_id.capture_key in self._running:
            return AttemptRunning(
                f"attempt {episode_id.attempt} of rollout {episode_id.rollout_id!r} is already running here",
                episodes=[episode_id.capture_key],
                rollout_id=episode_id.rollout_id,
                attempt=episode_id.attempt,
            )
        return None

    async def run(self, episode_id: EpisodeId, call: Callable[[Send], Awaitable[None]], send: Send) -> None:
        """Run one ``/run`` request as a registered restart episode."""
        while not self._open.is_set():
            await self._open.wait()
        error = self.refusal(episode_id)
        if error is not None:
            await _reply(send, error)
            return
        key = episode_id.capture_key
        task = asyncio.current_task()
        assert task is not None
        self._running[key] = task
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await call(tracked_send)
        except asyncio.CancelledError:
            if self._stopping.get(key) is not task:
                raise
            task.uncancel()  # retired by the controller: answer as the gate answers a retired attempt
            if not started:
                await _reply(send, _stale(episode_id))
        finally:
            if self._running.get(key) is task:
                del self._running[key]

    # -- participant hooks -------------------------------------------------------------------------

    @hookimpl
    def close_admission(self, checkpoint_id: str) -> None:
        self._open.clear()

    @hookimpl
    def open_admission(self, checkpoint_id: str) -> None:
        self._open.set()

    @hookimpl
    def ready(self, checkpoint_id: str | None) -> Readiness:
        return Readiness(restarts=list(self._running), counts={"uncaptured_runs": len(self._running)})

    @hookimpl
    async def retire(self, episode_ids: list[EpisodeId]) -> None:
        limits: dict[str, int] = {}
        for episode_id in episode_ids:
            limits[episode_id.rollout_id] = max(limits.get(episode_id.rollout_id, -1), episode_id.attempt)

        def named(key: str) -> bool:
            episode_id = from_capture_key(key)
            return episode_id.attempt <= limits.get(episode_id.rollout_id, -1)

        current = asyncio.current_task()
        for key, task in list(self._running.items()):
            if not named(key) or task is current or task.done() or key in self._stopping:
                continue
            # Cancelled once: a retried retire only waits (a second cancel would interrupt its cleanup).
            task.cancel()
            stopping_until_done(self._stopping, key, task)
        tasks = [task for key, task in self._stopping.items() if task is not current and named(key)]
        if tasks:
            await asyncio.wait(tasks)

    @hookimpl
    def status_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"uncaptured_runs": len(self._running)}
        if self.kind == "environment":
            # Every one a restart; listed so that ng-checkpoint commit --all knows this environment's episodes.
            fields["episode_keys"] = sorted(self._running)
        if self.restart_warning:
            fields["restart_warning"] = self.restart_warning
        return fields


def _environment_warning(server: Any) -> str:
    name = getattr(getattr(server, "config", None), "name", None) or type(server).__name__
    return (
        f"environment server {name!r} ({type(server).__name__}) runs episodes whose steps no participant "
        "reports, so every /run episode is a restart: its rollouts start over after a crash. To continue "
        "them, implement the participant hooks ready, export, install, retire and delete_restored for its "
        "episode state in a plugin (docs/plugins.md)."
    )


def _stale(episode_id: EpisodeId) -> StaleAttempt:
    return StaleAttempt(
        f"attempt {episode_id.attempt} of rollout {episode_id.rollout_id!r} was retired",
        rollout_id=episode_id.rollout_id,
        attempt=episode_id.attempt,
    )


async def _reply(send: Send, error: CheckpointError) -> None:
    body = orjson.dumps(error.to_body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def names_no_episode(body: bytes) -> bool:
    """A JSON object (as Gym reads it) that names no episode: work nobody could attribute."""
    try:
        data = orjson.loads(body)
    except ValueError:
        data = json_as_gym_reads(body)
    return isinstance(data, dict)


def rollout_id_required(kind: str) -> RolloutIdRequired:
    return RolloutIdRequired(
        f"a {kind} /run with checkpointing on must name its episode (episode_id, or _ng_rollout_id, or "
        "_ng_task_index and _ng_rollout_index): it could never be retired, restarted or listed in a checkpoint"
    )


class RunTracker:
    """Pure ASGI middleware: every ``POST /run`` runs through ``UncapturedRuns.run``."""

    def __init__(self, app: Any, *, runs: UncapturedRuns, run_path: str = "/run") -> None:
        self._app = app
        self._runs = runs
        self._run_path = run_path

    async def __call__(self, scope: Any, receive: Any, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != self._run_path or scope.get("method") != "POST":
            await self._app(scope, receive, send)
            return
        body, receive = await buffer_body(receive)
        episode_id = episode_of_run_body(body)
        if episode_id is None:
            if names_no_episode(body):
                await _reply(send, rollout_id_required(self._runs.kind))
                return
            await self._app(scope, receive, send)  # not a JSON object: the route's validation answers
            return
        await self._runs.run(episode_id, lambda tracked: self._app(scope, receive, tracked), send)


def install_run_tracker(app: Any, runs: UncapturedRuns) -> None:
    """Add ``RunTracker`` to ``app`` (before the gate is added, so the gate stays outermost)."""
    app.add_middleware(RunTracker, runs=runs)
