"""Built-in participants for the Gym server kinds (installed as ``nemo_gym_checkpoint_plugin.builtin_participants``).

- environment: ``EpisodeBook`` (``environment.py``), fed by the ``single_agent_turn`` run
  logic of ``single_agent_turn.py`` (a mixin the wrapper adds to that server class), and by
  the ``legacy_agent`` relay of ``legacy_agent.py`` (every relayed episode is a restart);
- agent: ``SimpleAgentSessions`` (``agent.py``), open Simple Agent sessions across a crash,
  with each session's turn so far when the wrapper added ``SimpleAgentTurns``
  (``simple_agent_turns.py``, ``agent_turns.py``: a boundary after each model and tool call);
- resources: ``ResourcesSessions`` (``resources.py``), seed declarations and session bindings,
  following the verifier's ``checkpoint_mode`` (``declarations.py``: its config key, or the
  built-in table of the wheel's stateless verifiers), and the per-session dicts a server names
  in ``checkpoint_session_state`` or the built-in table (``session_state.py``);
- agents' ``/run`` and environments without steps: ``UncapturedRuns`` (``uncaptured.py``),
  each such episode listed as a restart, work without a rollout id refused;
- model: ``ModelCalls`` (``model.py``), the model calls in flight: responses held while a
  checkpoint is open (``held_responses.py``), running generations stopped by retire; with Gym's
  token capture, the rows each server owns (``capture_book.py``) carried across a restore
  (``model_capture.py``, the rows in ``capture_rows.py``, the directory in ``capture_files.py``),
  and the startup check that every model server a capturing agent calls is a participant
  (``capture_config.py``).

The Gym attachment asks ``participants_for`` which plugins a server gets, and
``install_reply_declarations`` to add the reply headers they declare on. A server kind or
class without a built-in participant gets none, except that an environment whose run logic
does not report steps, and every agent's ``/run``, hold no capturable episode: those are
listed as restarts (``uncaptured.py``). The environment treats an agent that does not
declare its sessions capturable as a source of restarts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nemo_gym_checkpoint_plugin._settings import CheckpointSettings

__all__ = ["checkpointable_bases", "install_reply_declarations", "participants_for"]

_STEPPED_ENVIRONMENTS = ("SingleAgentTurnEnvironmentServer",)
# Agents whose turn loop is Simple Agent's: their turns record mid-turn boundaries (simple_agent_turns.py).
_TURN_AGENTS = ("SimpleAgent",)
# Relays to an agent that owns its whole episode: every episode is a restart (legacy_agent.py).
_RELAY_ENVIRONMENTS = ("LegacyAgentEnvironmentServer",)


def checkpointable_bases(server_class: type) -> tuple[type, ...]:
    """Mixins to put before ``server_class`` so its episodes report their steps (empty: none known)."""
    if any(base.__name__ in _STEPPED_ENVIRONMENTS for base in server_class.__mro__):
        from nemo_gym_checkpoint_plugin.builtin_participants.single_agent_turn import SingleAgentTurnSteps

        if not issubclass(server_class, SingleAgentTurnSteps):
            if hasattr(server_class, "_episode_request_from_row"):
                # Gym's legacy flat-row wrapper (single_agent_turn_legacy): explicit "<id>-aN" ids decoded.
                from nemo_gym_checkpoint_plugin.builtin_participants.legacy_rows import LegacyRowIds

                return (LegacyRowIds, SingleAgentTurnSteps)
            return (SingleAgentTurnSteps,)
    if any(base.__name__ in _TURN_AGENTS for base in server_class.__mro__):
        from nemo_gym_checkpoint_plugin.builtin_participants.simple_agent_turns import SimpleAgentTurns

        if not issubclass(server_class, SimpleAgentTurns):
            return (SimpleAgentTurns,)
    if any(base.__name__ in _RELAY_ENVIRONMENTS for base in server_class.__mro__):
        from nemo_gym_checkpoint_plugin.builtin_participants.legacy_agent import LegacyAgentRelay

        if not issubclass(server_class, LegacyAgentRelay):
            return (LegacyAgentRelay,)
    return ()


def participants_for(server: Any, kind: str, settings: CheckpointSettings) -> list[Any]:
    """The built-in participant plugins of ``server`` (a Gym server of ``kind``), bound to it.

    An environment with stepped run logic gets an ``EpisodeBook`` (step mode from
    ``checkpoint.step_mode``) and takes over its episode deadline. Call once, only when checkpointing is enabled.
    """
    if kind == "environment" and hasattr(server, "bind_episode_book"):
        from nemo_gym_checkpoint_plugin.builtin_participants.environment import EpisodeBook, StepMode
        from nemo_gym_checkpoint_plugin.builtin_participants.single_agent_turn import validate_state

        book = EpisodeBook(StepMode(settings.step_mode), validate_state=validate_state)
        server.bind_episode_book(book)
        return [book]
    if kind == "environment" and hasattr(server, "bind_relay_book"):
        from nemo_gym_checkpoint_plugin.builtin_participants.legacy_agent import relay_book

        book = relay_book(settings.step_mode)
        server.bind_relay_book(book)
        return [book]
    if kind == "environment":
        # No steps for this run logic: its episodes are listed as restarts, never silently lost.
        from nemo_gym_checkpoint_plugin.builtin_participants.uncaptured import UncapturedRuns

        name = getattr(getattr(server, "config", None), "name", None) or type(server).__name__
        return [
            UncapturedRuns(
                kind,
                restart_warning=(
                    f"environment server {name!r} ({type(server).__name__}) runs episodes whose steps no participant "
                    "reports, so every /run episode is a restart: its rollouts start over after a crash. To continue "
                    "them, implement the participant hooks ready, export, install, retire and delete_restored for its "
                    "episode state in a plugin (docs/plugins.md)."
                ),
            )
        ]
    if kind == "agent":
        from nemo_gym_checkpoint_plugin.builtin_participants.agent import SimpleAgentSessions, is_session_agent
        from nemo_gym_checkpoint_plugin.builtin_participants.uncaptured import UncapturedRuns

        # An agent's /run owns its whole episode: never capturable, always a restart.
        runs = UncapturedRuns(kind)
        if not is_session_agent(server):
            return [runs]
        return [SimpleAgentSessions(server, _turn_book(server)), runs]
    if kind == "resources":
        from nemo_gym_checkpoint_plugin.builtin_participants.resources import ResourcesSessions

        return [ResourcesSessions(server)]
    if kind == "model":
        from nemo_gym_checkpoint_plugin.builtin_participants.model import ModelCalls

        return [ModelCalls(server)]
    return []


def _turn_book(server: Any) -> Any:
    """A bound ``TurnBook`` when ``server`` runs Simple Agent's own turn loop under the mixin, else None."""
    from nemo_gym_checkpoint_plugin.builtin_participants.simple_agent_turns import captures_mid_turn

    if not captures_mid_turn(server):
        return None
    from nemo_gym_checkpoint_plugin.builtin_participants.agent_turns import TurnBook

    book = TurnBook(model_server=server.config.model_server.name)
    server.bind_turn_book(book)
    return book


def install_reply_declarations(app: Any, participants: Any, plugins: list[Any]) -> None:
    """Add the reply-header middleware the built-in ``plugins`` declare through (before the gate is added)."""
    from nemo_gym_checkpoint_plugin.builtin_participants.agent import SimpleAgentSessions, install_agent_declaration
    from nemo_gym_checkpoint_plugin.builtin_participants.model import ModelCalls, install_model_calls
    from nemo_gym_checkpoint_plugin.builtin_participants.resources import (
        ResourcesSessions,
        install_resources_declarations,
    )
    from nemo_gym_checkpoint_plugin.builtin_participants.uncaptured import UncapturedRuns, install_run_tracker

    for plugin in plugins:
        if isinstance(plugin, UncapturedRuns):
            install_run_tracker(app, plugin)
        elif isinstance(plugin, ResourcesSessions):
            install_resources_declarations(app, participants, plugin)
        elif isinstance(plugin, SimpleAgentSessions):
            install_agent_declaration(app, mid_turn=plugin.turns is not None, sessions=plugin)
        elif isinstance(plugin, ModelCalls):
            install_model_calls(app, plugin)
