"""The agent participant: an agent's open sessions, and its turns continued from their last call.

- ``open_sessions.py``: ``SimpleAgentSessions``, the participant: each open session exported and
  installed as the replacement attempt's (a ``Versioned`` record each, built by ``session_record.py``);
- ``turn_journal.py``: the journal of a turn's completed model and tool calls (its mid-turn
  boundaries), replayed when the turn is sent again after a restore;
- ``turn_loop.py``: the mixin that runs the agent's turn loop against that journal.
"""
