"""Built-in participants for the Gym server kinds (installed as ``nemo_gym_checkpoint_plugin.builtin_participants``).

One subpackage per kind of server, each docstring listing its modules:

- ``environment``: ``EpisodeBook`` (``environment/episode_book.py``), fed by the run logic of an
  environment whose episode is one agent turn (``environment/steps.py``, a mixin the wrapper adds
  to Gym's ``single_agent_turn`` server class), and by the relay to an agent that owns its whole
  episode (``environment/relay.py``, Gym's ``legacy_agent``: every relayed episode is a restart);
- ``agent``: ``SimpleAgentSessions`` (``agent/open_sessions.py``), open Simple Agent sessions
  across a crash, with each session's turn so far when the wrapper added ``SimpleAgentTurns``
  (``agent/turn_loop.py``, ``agent/turn_journal.py``: a boundary after each model and tool call);
- ``resources``: ``ResourcesSessions`` (``resources/session_bindings.py``), seed declarations and
  session bindings, following the verifier's ``checkpoint_mode`` (``resources/checkpoint_modes.py``:
  its config key, or the built-in table of the wheel's stateless verifiers), and the per-session
  dicts a server names in ``checkpoint_session_state`` or the built-in table
  (``resources/session_state.py``);
- ``model``: ``ModelCalls`` (``model/calls.py``), the model calls in flight: responses held while
  a checkpoint is open, running generations stopped by retire; with Gym's token capture, the
  rows each server owns carried across a restore (``model/token_capture.py``, ``model/capture_*.py``);
  with generation cuts, a generation in flight continued from its tokens (``model/cut_*.py``);
- ``shared``: what several kinds use: the attempts a retire names, the reply-header middleware,
  and ``UncapturedRuns`` (``shared/uncaptured_runs.py``): an agent's ``/run`` and an environment
  without steps hold no capturable episode, so each such episode is listed as a restart and work
  without a rollout id is refused.

The Gym attachment registers ``builtin_plugins()`` on every server; each joins through the
``attach`` hook as a third-party plugin does, and adds its middleware in ``serving``. The
environment treats an agent that does not declare its sessions capturable as a source of restarts.
"""

from __future__ import annotations

from typing import Any

__all__ = ["builtin_plugins", "checkpointable_bases"]

_STEPPED_ENVIRONMENTS = ("SingleAgentTurnEnvironmentServer",)
# Agents whose turn loop is Simple Agent's: their turns record mid-turn boundaries (agent/turn_loop.py).
_TURN_AGENTS = ("SimpleAgent",)
# Relays to an agent that owns its whole episode: every episode is a restart (environment/relay.py).
_RELAY_ENVIRONMENTS = ("LegacyAgentEnvironmentServer",)


def checkpointable_bases(server_class: type) -> tuple[type, ...]:
    """Mixins to put before ``server_class`` so its episodes report their steps (empty: none known)."""
    if any(base.__name__ in _STEPPED_ENVIRONMENTS for base in server_class.__mro__):
        from nemo_gym_checkpoint_plugin.builtin_participants.environment.steps import SingleAgentTurnSteps

        if not issubclass(server_class, SingleAgentTurnSteps):
            if hasattr(server_class, "_episode_request_from_row"):
                # Gym's legacy flat-row wrapper (single_agent_turn_legacy): explicit "<id>-aN" ids decoded.
                from nemo_gym_checkpoint_plugin.builtin_participants.environment.flat_rows import LegacyRowIds

                return (LegacyRowIds, SingleAgentTurnSteps)
            return (SingleAgentTurnSteps,)
    if any(base.__name__ in _TURN_AGENTS for base in server_class.__mro__):
        from nemo_gym_checkpoint_plugin.builtin_participants.agent.turn_loop import SimpleAgentTurns

        if not issubclass(server_class, SimpleAgentTurns):
            return (SimpleAgentTurns,)
    if any(base.__name__ in _RELAY_ENVIRONMENTS for base in server_class.__mro__):
        from nemo_gym_checkpoint_plugin.builtin_participants.environment.relay import LegacyAgentRelay

        if not issubclass(server_class, LegacyAgentRelay):
            return (LegacyAgentRelay,)
    return ()


def builtin_plugins() -> list[Any]:
    """Fresh built-in participant plugins, one of each, for one server process.

    Registered on every checkpointed server's plugin manager ahead of third parties; each joins
    through the ``attach`` hook, exactly as a third-party plugin does, answering ``False`` on a
    server it does not serve (it is then unregistered), and adds its middleware and takes the
    retired marks in ``serving``. What a server of each kind keeps:

    - environment: ``SingleAgentTurnBook`` (run logic ``SingleAgentTurnSteps``), else
      ``RelayBook`` (the ``legacy_agent`` relay), else ``UncapturedRuns`` (every episode a restart);
    - agent: ``SimpleAgentSessions`` (a Simple Agent) and ``UncapturedRuns`` (its ``/run``);
    - resources: ``ResourcesSessions``; model: ``ModelCalls``.
    """
    from nemo_gym_checkpoint_plugin.builtin_participants.agent.open_sessions import SimpleAgentSessions
    from nemo_gym_checkpoint_plugin.builtin_participants.environment.relay import RelayBook
    from nemo_gym_checkpoint_plugin.builtin_participants.environment.steps import SingleAgentTurnBook
    from nemo_gym_checkpoint_plugin.builtin_participants.model.calls import ModelCalls
    from nemo_gym_checkpoint_plugin.builtin_participants.resources.session_bindings import ResourcesSessions
    from nemo_gym_checkpoint_plugin.builtin_participants.shared.uncaptured_runs import UncapturedRuns

    return [
        SingleAgentTurnBook(),
        RelayBook(),
        SimpleAgentSessions(),
        UncapturedRuns(),
        ResourcesSessions(),
        ModelCalls(),
    ]
