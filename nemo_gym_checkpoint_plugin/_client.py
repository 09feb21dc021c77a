"""The server client a checkpointing Gym server uses for its calls to other Gym servers.

Gym's ``ServerClient`` has two habits that break checkpointing, and this subclass
changes exactly those (installed by the attachment only when checkpointing is on):

- **Resending work.** Gym's request loop retries an internal call without limit after a
  dropped connection (``ServerDisconnectedError``, ``ClientOSError``). For ``/run`` (and
  an agent's ``/v1/responses``, the episode work an environment hands its agent) a
  resend after a crash starts the same attempt twice beside its restored copy. Those
  calls are made once: the caller gets the connection error and decides.
- **Unattributed calls.** Gym adds the ``/ng-rollout/<capture key>`` path prefix to
  model and resources calls only with ``observability_enabled``. The admission gate
  attributes data requests to their episode attempt by that prefix, so this client adds
  it whenever the call runs inside a rollout: ``nemo_gym.rollout_correlation``'s
  context, which Gym sets in an environment's ``/run``, in resources and model servers
  (their middlewares strip the prefix and set it) and, through the attachment, in
  agents. A resources call outside any rollout context falls back to the capture key
  of its JSON body (``_ng_rollout_id`` / indices / attempt), as Gym does for
  ``/verify``. Both receiving kinds strip the prefix before routing in nemo-gym 0.7.0
  (``RolloutContextMiddleware``, the model capture middleware), so routes are unchanged.
  ``_resolve_base_url`` of a resources server, asked inside a rollout, answers the
  prefixed base URL: ``single_agent_turn`` hands that base to the agent as the episode's
  direct tool access, so tool calls (which bypass this client) are attributed too.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from nemo_gym.config_types import ROLLOUT_PATH_PREFIX, TOKEN_CAPTURE_PATH_SEGMENT
from nemo_gym.rollout_correlation import current_rollout_id, maybe_rollout_id_from_run_body
from nemo_gym.server_utils import ServerClient, rollout_path_prefix
from pydantic import BaseModel

__all__ = ["CheckpointServerClient", "never_resent", "server_kind_of"]

_ROLLOUT_SEGMENT = f"/{ROLLOUT_PATH_PREFIX}/"
# Top-level key under a server's config entry -> the kind of server it is.
_KIND_BY_TYPE_KEY = {
    "responses_api_models": "model",
    "resources_servers": "resources",
    "responses_api_agents": "agent",
    "environment_servers": "environment",
}
# Set while this client's own request builds its URL, so the base URL it resolves stays unprefixed.
_RESOLVING_OWN_REQUEST: ContextVar[bool] = ContextVar("ng_checkpoint_resolving_own_request", default=False)


def server_kind_of(global_config: Any, server_name: str) -> str | None:
    """``model`` / ``resources`` / ``agent`` / ``environment`` for a configured server name, else None."""
    entry = global_config.get(server_name) if global_config is not None else None
    if entry is None or not hasattr(entry, "keys"):
        return None
    for type_key, kind in _KIND_BY_TYPE_KEY.items():
        if type_key in entry:
            return kind
    return None


def _unprefixed(url_path: str) -> str:
    """``url_path`` without a leading ``/ng-rollout/<id>`` (and token-capture segment)."""
    if not url_path.startswith(_ROLLOUT_SEGMENT):
        return url_path
    rest = url_path[len(_ROLLOUT_SEGMENT) :].partition("/")[2]
    rest = "/" + rest
    capture = f"/{TOKEN_CAPTURE_PATH_SEGMENT}/"
    return rest[len(capture) - 1 :] if rest.startswith(capture) else rest


def never_resent(kind: str | None, url_path: str) -> bool:
    """Whether a call to a server of ``kind`` at ``url_path`` starts episode work (made at most once)."""
    path = _unprefixed(url_path.partition("?")[0])
    return path == "/run" or (kind == "agent" and path == "/v1/responses")


class CheckpointServerClient(ServerClient):
    """A ``ServerClient`` that never resends episode work and always attributes calls to their rollout."""

    @classmethod
    def from_client(cls, client: ServerClient) -> CheckpointServerClient:
        """The same configuration as ``client`` (its head server and global config), with this behaviour."""
        if isinstance(client, cls):
            return client
        return cls(head_server_config=client.head_server_config, global_config_dict=client.global_config_dict)

    def _rollout_for(self, kind: str | None, json_obj: Any) -> str | None:
        if kind not in ("model", "resources"):
            return None
        rollout_id = current_rollout_id()
        if rollout_id is None and kind == "resources":
            try:
                rollout_id = maybe_rollout_id_from_run_body(json_obj)
            except ValueError:
                # A malformed explicit id stays unattributed; the receiving server validates the body.
                rollout_id = None
        return rollout_id

    def attributed_path(self, server_name: str, url_path: str, json_obj: Any = None) -> str:
        """``url_path`` with the rollout prefix this client sends it with (unchanged outside a rollout)."""
        kind = server_kind_of(self.global_config_dict, server_name)
        if url_path.startswith(_ROLLOUT_SEGMENT):
            return url_path
        return rollout_path_prefix(self._rollout_for(kind, json_obj)) + url_path

    async def request(self, server_name: str, url_path: str, method: str, **kwargs: Any) -> Any:
        kind = server_kind_of(self.global_config_dict, server_name)
        json_obj = kwargs.get("json")
        if isinstance(json_obj, BaseModel):
            json_obj = json_obj.model_dump(exclude_unset=True)
            kwargs["json"] = json_obj
        url_path = self.attributed_path(server_name, url_path, json_obj)
        if never_resent(kind, url_path):
            # Gym's request loop gives up after this many connection failures (one: no resend).
            kwargs["_max_connection_retries"] = 1
        token = _RESOLVING_OWN_REQUEST.set(True)
        try:
            return await super().request(server_name=server_name, url_path=url_path, method=method, **kwargs)
        finally:
            _RESOLVING_OWN_REQUEST.reset(token)

    def _resolve_base_url(self, server_name: str) -> str:
        base = super()._resolve_base_url(server_name)
        if _RESOLVING_OWN_REQUEST.get():
            return base
        if server_kind_of(self.global_config_dict, server_name) != "resources":
            return base
        return base.rstrip("/") + rollout_path_prefix(current_rollout_id())
