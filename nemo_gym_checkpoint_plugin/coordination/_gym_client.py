"""The public controller client: Gym's own ``ServerClient`` and rollout collection, made safe to checkpoint.

For a controller that is not ours (a trainer such as NeMo RL driving Gym through Gym's own
``ServerClient`` and ``RolloutCollectionHelper``). Nothing in Gym is patched; two things are
configured:

- **No resend of ``/run``.** Gym's request loop resends an internal call without limit after a
  dropped connection (``ServerDisconnectedError``, ``ClientOSError``). After a crash of the
  environment that starts the same attempt twice beside its restored copy (docs/protocol.md
  "Coordination order"). ``ControllerServerClient`` sends every ``POST .../run`` at most once:
  the caller gets the connection error and decides (retire, restore, resend as the next attempt).
  Every other call is Gym's, unchanged. ``ControllerCollectionHelper`` is Gym's
  ``RolloutCollectionHelper`` whose ``setup_server_client`` returns that client, so
  ``run_examples`` and ``run_from_config`` dispatch through it.
- **The next attempt.** After a restore a rollout continues as its replacement attempt N+1 (and a
  restart starts over as its next attempt). ``row_at_attempt(row, N)`` is the row Gym's own
  dispatch sends as attempt N: an explicit ``_ng_rollout_id`` becomes ``"<id>-aN"`` (what Gym's
  ``_episode_request_body`` sends as ``{"rollout_id": "<id>-aN", "attempt": 0}``, which an
  environment server with checkpointing on decodes as attempt N of ``<id>``), any other row gets
  ``_ng_attempt_index: N``. ``row_episode(row)`` is the ``{"rollout_id", "attempt"}`` a row goes
  out as: what a commit scope, a restore, a retire name.

Importing this module loads Gym's rollout collection (about a second); the coordination package
exports these names lazily, so ``import nemo_gym_checkpoint_plugin.coordination`` stays light.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nemo_gym.global_config import (
    ATTEMPT_INDEX_KEY_NAME,
    ROLLOUT_ID_KEY_NAME,
    ROLLOUT_INDEX_KEY_NAME,
    TASK_INDEX_KEY_NAME,
)
from nemo_gym.rollout_collection import RolloutCollectionHelper
from nemo_gym.rollout_correlation import maybe_rollout_id_from_run_body
from nemo_gym.server_utils import BaseServerConfig, ServerClient
from pydantic import PrivateAttr

from .._identity import capture_key, episode_to_wire, from_capture_key

__all__ = ["ControllerCollectionHelper", "ControllerServerClient", "is_run_call", "row_at_attempt", "row_episode"]


def is_run_call(method: str, url_path: str) -> bool:
    """Whether a call starts episode work: a ``POST`` whose path (query aside) ends in ``/run``."""
    return method.upper() == "POST" and url_path.partition("?")[0].rstrip("/").rsplit("/", 1)[-1] == "run"


class ControllerServerClient(ServerClient):
    """Gym's ``ServerClient`` that never resends a ``/run`` after a dropped connection."""

    @classmethod
    def from_client(cls, client: ServerClient) -> ControllerServerClient:
        """The same head server and global config as ``client`` (a Gym ``ServerClient``), with this rule."""
        if isinstance(client, cls):
            return client
        return cls(head_server_config=client.head_server_config, global_config_dict=client.global_config_dict)

    async def request(self, server_name: str, url_path: str, method: str, **kwargs: Any) -> Any:
        if is_run_call(method, url_path):
            # Gym's request loop gives up after this many failures: one, so a /run is never sent twice.
            kwargs["_max_connection_retries"] = 1
        return await super().request(server_name=server_name, url_path=url_path, method=method, **kwargs)


class ControllerCollectionHelper(RolloutCollectionHelper):
    """Gym's ``RolloutCollectionHelper``; its rows are dispatched through ``ControllerServerClient``.

    By default the client is Gym's own (``setup_server_client``: the head server's config);
    ``using(client)`` dispatches through a ``ServerClient`` the controller already holds.
    """

    _server_client: ServerClient | None = PrivateAttr(default=None)

    @classmethod
    def using(cls, client: ServerClient) -> ControllerCollectionHelper:
        helper = cls()
        helper._server_client = ControllerServerClient.from_client(client)
        return helper

    def setup_server_client(self, head_server_config: BaseServerConfig | None = None) -> ServerClient:
        if self._server_client is not None:
            return self._server_client
        return ControllerServerClient.from_client(super().setup_server_client(head_server_config))


def _base_rollout_id(row: Mapping[str, Any]) -> str:
    key = maybe_rollout_id_from_run_body({**row, ATTEMPT_INDEX_KEY_NAME: 0})
    if key is None:
        key = f"{row[TASK_INDEX_KEY_NAME]}-{row[ROLLOUT_INDEX_KEY_NAME]}"
    return from_capture_key(key).rollout_id


def row_episode(row: Mapping[str, Any]) -> dict[str, Any]:
    """``{"rollout_id", "attempt"}`` of the episode Gym's dispatch sends ``row`` as.

    An explicit ``"<id>-aN"`` is attempt N of ``<id>``; otherwise the rollout id is the explicit
    ``_ng_rollout_id`` or Gym's ``<task index>-<rollout index>``, and the attempt ``_ng_attempt_index``
    (default 0). ``ValueError`` for a row naming its attempt twice (suffix and a non-zero index).
    """
    key = maybe_rollout_id_from_run_body(row)
    explicit = row.get(ROLLOUT_ID_KEY_NAME)
    attempt = row.get(ATTEMPT_INDEX_KEY_NAME) or 0
    if isinstance(explicit, str) and attempt and from_capture_key(explicit).rollout_id != explicit:
        raise ValueError(
            f"row names its attempt twice: {ROLLOUT_ID_KEY_NAME}={explicit!r} and {ATTEMPT_INDEX_KEY_NAME}={attempt}"
        )
    if key is None:
        key = capture_key(f"{row[TASK_INDEX_KEY_NAME]}-{row[ROLLOUT_INDEX_KEY_NAME]}", attempt)
    return episode_to_wire(from_capture_key(key))


def row_at_attempt(row: Mapping[str, Any], attempt: int) -> dict[str, Any]:
    """A copy of ``row`` that Gym's own dispatch sends as ``attempt`` of its rollout (see the module docstring)."""
    if type(attempt) is not int or attempt < 0:
        raise ValueError(f"attempt must be an int >= 0, got {attempt!r}")
    rollout_id = _base_rollout_id(row)
    out = dict(row)
    if isinstance(row.get(ROLLOUT_ID_KEY_NAME), str):
        # An explicit id names its attempt itself; an attempt index beside it would be ambiguous.
        out[ROLLOUT_ID_KEY_NAME] = capture_key(rollout_id, attempt)
        out.pop(ATTEMPT_INDEX_KEY_NAME, None)
    elif attempt:
        out[ATTEMPT_INDEX_KEY_NAME] = attempt
    else:
        out.pop(ATTEMPT_INDEX_KEY_NAME, None)
    return out
