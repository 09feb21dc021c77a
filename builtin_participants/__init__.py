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

The Gym attachment registers ``builtin_plugins()`` on every server; each joins through the
``attach`` hook as a third-party plugin does, and adds its middleware in ``serving``. An
environment whose run logic does not report steps, and every agent's ``/run``, hold no
capturable episode: those are listed as restarts (``uncaptured.py``). The environment treats an agent that does not
declare its sessions capturable as a source of restarts.
"""

from __future__ import annotations

from typing import Any

__all__ = ["builtin_plugins", "checkpointable_bases"]

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
    from nemo_gym_checkpoint_plugin.builtin_participants.agent import SimpleAgentSessions
    from nemo_gym_checkpoint_plugin.builtin_participants.legacy_agent import RelayBook
    from nemo_gym_checkpoint_plugin.builtin_participants.model import ModelCalls
    from nemo_gym_checkpoint_plugin.builtin_participants.resources import ResourcesSessions
    from nemo_gym_checkpoint_plugin.builtin_participants.single_agent_turn import SingleAgentTurnBook
    from nemo_gym_checkpoint_plugin.builtin_participants.uncaptured import UncapturedRuns

    return [
        SingleAgentTurnBook(),
        RelayBook(),
        SimpleAgentSessions(),
        UncapturedRuns(),
        ResourcesSessions(),
        ModelCalls(),
    ]
