"""The resources participant: a verifier's seed declarations, session bindings and session state.

- ``session_bindings.py``: ``ResourcesSessions``, the participant: seed declarations and each
  session's binding to its episode, carried across a crash;
- ``tool_requests.py``: ``ToolRequests``, the middleware counting tool calls and tracking each request
  under a rollout prefix, so a retire can stop it;
- ``checkpoint_modes.py``: how a verifier checkpoints (its ``checkpoint_mode``, or the built-in table);
- ``session_state.py``: the per-session dict attributes a server names, exported and installed;
- ``task_ids.py``: Gym's ``TaskId`` to and from its JSON form by plain checks (pydantic's own where they differ).
"""
