"""Names on the wire, shared by the server runtime and the controller side (docs/protocol.md).

One place for every string both sides (or several modules of one side) must agree on:
the control routes' prefix, the checkpoint id pattern, Gym's rollout path prefix, the
top-level keys of Gym's config that hold servers, and the headers a participant declares
through. The episode ids on the wire (capture keys, ``{"rollout_id", "attempt"}``) are
``_identity``'s.
"""

from __future__ import annotations

__all__ = [
    "AGENT_SESSION_CAPTURE",
    "AGENT_SESSION_HEADER",
    "AGENT_SESSION_MID_TURN",
    "CHECKPOINT_ID_PATTERN",
    "CONTROL_PATH_PREFIX",
    "CONTROL_PREFIX",
    "OWNER_PATTERN",
    "RESTART_HEADER",
    "ROLLOUT_PATH_PREFIX",
    "SERVER_TYPES",
    "VERIFY_HEADER",
]

# The control routes: /ng-control/v1/checkpoint/{status,prepare,renew,commit,restore,resume,retire,forget}.
CONTROL_PREFIX = "/ng-control/v1/checkpoint"
# Everything under it passes the admission gate (the controller must reach a closed participant).
CONTROL_PATH_PREFIX = "/ng-control/"
CHECKPOINT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
# A controller's owner id (1 to 200 characters): ``collect-<run>@<host>``, ``cli-<user>@<host>``...
OWNER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+-]*$"

# Gym's ROLLOUT_PATH_PREFIX ("ng-rollout") as a path prefix: /ng-rollout/<capture key>/<route>.
ROLLOUT_PATH_PREFIX = "/ng-rollout/"

# The server types of Gym's config (``<name>: {<server type>: {<implementation>: {...}}}``), in the
# order discovery lists participants: models, resources, agents, environments.
SERVER_TYPES = ("responses_api_models", "resources_servers", "responses_api_agents", "environment_servers")

# A resources seed reply declaring its episode a restart (value "1").
RESTART_HEADER = "x-ng-checkpoint-restart"
# A resources seed reply declaring /verify replayable (value "replay").
VERIFY_HEADER = "x-ng-checkpoint-verify"
# An agent's /v1/agent_sessions reply declaring its sessions capturable: "capture" (between
# turns: a turn in flight must finish first) or "mid-turn" (it also records a boundary after each
# model and tool call of a turn, so a turn in flight never blocks a checkpoint).
AGENT_SESSION_HEADER = "x-ng-checkpoint-agent-session"
AGENT_SESSION_CAPTURE = "capture"
AGENT_SESSION_MID_TURN = "mid-turn"
