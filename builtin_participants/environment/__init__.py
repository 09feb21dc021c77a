"""The environment participant: episodes an environment server runs in steps, parked at their boundaries.

- ``episode_book.py``: ``EpisodeBook``, the participant (admission, readiness, the boundaries);
  ``episode.py``: what it keeps per episode; ``episode_records.py``: its records and retire;
- ``steps.py``: the run logic of an environment whose episode is one agent turn (Gym's
  ``single_agent_turn``): seed, agent and verify as steps with a boundary after each, and the
  wire calls of each step in ``step_calls.py``;
- ``flat_rows.py``: the flat-row variant's explicit ``"<id>-aN"`` rollout ids;
- ``relay.py``: an environment that relays each episode to an agent owning it whole (Gym's
  ``legacy_agent``): every such episode is a restart.
"""
