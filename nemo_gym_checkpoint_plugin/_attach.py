"""Attach checkpointing to one Gym server's FastAPI app: the single place both attachment modes go through.

``attach_checkpointing(server, app)`` runs after the server's own ``setup_webserver()``
built ``app`` and before Gym's ``run_webserver`` adds its liveness, exception and
cancellation middleware. When the ``checkpoint:`` block is absent or disabled it
installs nothing at all. When enabled it:

1. builds the plugin manager (the built-in participants, ``builtin_participants.builtin_plugins``,
   then the entry-point group), lets every plugin learn its server through the ``attach``
   hook (a plugin answering ``False`` is unregistered: the built-ins join this way too), and builds this process's
   ``ControlPlane`` (kind from the server class, instance = the server's config name);
2. serves the control routes (``_routes.attach``: router + error handler);
3. adds the admission gate (``_gate.install_gate``) as the outermost middleware so far, so
   it sees raw ``/ng-rollout/<key>/...`` paths before Gym's own middleware strips them,
   and Gym's cancellation middleware (added later) still wraps it; on environments and
   agents it also attributes ``POST /run`` by its body (only while something is to decide);
   before the gate, every plugin's ``serving`` hook adds its middleware and takes the plane's
   retired marks (so an episode checks them where it begins too), and on resources servers
   the ``seed_session`` hook is wired to the seed replies (``_seeds.py``);
4. on agents, sets Gym's rollout context from the ``/ng-rollout/<key>`` prefix (agents
   route the prefix as a path parameter and never set the context themselves), so the
   plugin's client attributes the agent's model and resources calls;
5. on environments, decodes an explicit ``"<id>-aN"`` rollout id of a typed ``/run`` body as
   attempt N of ``<id>`` (``_explicit_ids.py``), outside the gate so the gate sees the attempt;
6. with ``num_workers > 1`` (model, resources and environment servers; agents are refused, see
   ``refuse_unsupported``) the server is one participant over several workers
   (``_workers/``, docs/protocol.md section 9a): in Gym's main process the app is never served,
   so only the coordinator starts (``_workers/service.py``: its own event loop thread, the one
   ``ControlPlane`` and its control routes, no participant plugin but the coordinator's); in
   each uvicorn worker the participants join and the worker side is installed instead of a plane
   (``_workers/attach.py``: gate, restored-record claims, control routes forwarded).

The plugin's server client (``_client.py``) is swapped in by ``install_client`` *before*
the server's ``setup_webserver()``, since a server may hand its client to what it builds.
Settings come from the global config the server was built with; a bad block raises
``SettingsError`` naming the key, before anything is installed; so does a
``checkpoint.storage.backend`` no plugin provides (``UnknownStorageBackend``, naming the
server and the backends available). So does a server config
checkpointing cannot serve yet (``refuse_unsupported``): ``expose_tools_over_mcp: true``
with the block enabled.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nemo_gym_checkpoint_plugin._settings import CheckpointSettings, SettingsError, load_settings
from nemo_gym_checkpoint_plugin._wire import ROLLOUT_PATH_PREFIX

__all__ = [
    "ATTACHMENT_STATE",
    "Attachment",
    "RolloutAttribution",
    "num_workers",
    "attach_checkpointing",
    "install_client",
    "refuse_unsupported",
    "server_kind",
    "server_settings",
]

logger = logging.getLogger(__name__)

# Where the attachment is kept on ``app.state`` (absent: checkpointing is off for this app).
ATTACHMENT_STATE = "ng_checkpoint_attachment"

# Gym base class name -> participant kind. Matched by name along the MRO, as Gym itself does,
# so that classifying a server never imports the other kinds' heavy base modules.
_KIND_BY_BASE = {
    "BaseEnvironmentServer": "environment",
    "SimpleResponsesAPIModel": "model",
    "SimpleResponsesAPIAgent": "agent",
    "SimpleResourcesServer": "resources",
}


def server_kind(server_class: type) -> str:
    """The participant kind of a Gym server class; ``TypeError`` for a class of no known kind."""
    for base in server_class.__mro__:
        kind = _KIND_BY_BASE.get(base.__name__)
        if kind is not None:
            return kind
    raise TypeError(
        f"{server_class.__qualname__} derives from none of {sorted(_KIND_BY_BASE)}: "
        "it cannot be a checkpoint participant"
    )


def server_settings(server: Any) -> tuple[CheckpointSettings, str | None]:
    """The validated ``checkpoint:`` block of the config ``server`` was built with, and its token (None: off).

    ``SettingsError`` names the server (its config name).
    """
    try:
        return load_settings(server.server_client.global_config_dict)
    except SettingsError as exc:
        raise exc.for_server(_server_name(server)) from None


def _server_name(server: Any) -> str | None:
    name = getattr(getattr(server, "config", None), "name", None)
    return str(name) if name else None


def refuse_unsupported(server_config: Any, settings: CheckpointSettings, global_config: Any = None) -> None:
    """Raise ``SettingsError`` (naming the keys) for a server config checkpointing does not support.

    Only with checkpointing enabled: a disabled block changes nothing. These are refused:

    - ``expose_tools_over_mcp: true``. Gym's MCP auto-exposure dispatches tool calls straight to
      the route handlers, past every middleware, so MCP calls would bypass the admission gate and
      the episode bookkeeping; Gym itself refuses any non-Gym middleware with a ``ValueError``
      once the app is built, which does not say why it is there;
    - on a model or agent server, a token-capturing agent naming a model server that is not a
      participant (``builtin_participants/model/capture_config.py``): its capture rows would fall
      outside every checkpoint. ``global_config`` is Gym's (default ``get_global_config_dict()``);
    - on a model server, a bad ``checkpoint_generation_cuts`` value or a server the cuts cannot
      serve (``builtin_participants/model/cut_settings.py``).
    """
    if not settings.enabled:
        return
    name = getattr(server_config, "name", None)
    workers = num_workers(server_config)
    if workers > 1 and _is_agent_config(server_config, global_config):
        raise SettingsError(
            f"num_workers: {workers} on an agent server together with checkpoint.enabled: true is not supported: an "
            "agent keeps its sessions in its one process (Gym's own rule: agent sessions require num_workers=1); "
            "set num_workers: 1 on this agent (model, resources and environment servers may run several workers)",
            server=str(name) if name else None,
        )
    if getattr(server_config, "expose_tools_over_mcp", False):
        raise SettingsError(
            "expose_tools_over_mcp: true together with checkpoint.enabled: true is not supported "
            "yet (Gym's MCP dispatch calls tool handlers directly, past the checkpoint admission gate); set "
            "expose_tools_over_mcp: false on this server or checkpoint.enabled: false",
            server=str(name) if name else None,
        )
    if global_config is None:
        from nemo_gym.global_config import get_global_config_dict

        global_config = get_global_config_dict()
    # Gym's config: an OmegaConf container or a plain dict, read by what it answers (``get``, ``keys``).
    block: Any = global_config.get(str(name)) if name and hasattr(global_config, "get") else None
    if not hasattr(block, "keys") or not {"responses_api_models", "responses_api_agents"} & set(block.keys()):
        return
    if "responses_api_models" in block.keys():
        from nemo_gym_checkpoint_plugin.builtin_participants.model.cut_settings import refuse_bad_cuts

        refuse_bad_cuts(server_config, global_config)
    from nemo_gym_checkpoint_plugin.builtin_participants.model.capture_config import (
        PARTICIPANT_KEY,
        uncheckpointed_capture,
    )

    outside = uncheckpointed_capture(global_config, str(name))
    if outside:
        pairs = ", ".join(f"agent {agent!r} calls model server {model!r}" for agent, model in outside)
        raise SettingsError(
            f"token capture with checkpointing needs every model server a capturing agent calls to be a checkpoint "
            f"participant, but {pairs}, which is not one: its capture rows would fall outside every checkpoint. "
            f"Run it through the plugin (entrypoint: -mnemo_gym_checkpoint_plugin.wrap; ng-checkpoint enable "
            f"writes that) or, for a server class using CheckpointMixin, set {PARTICIPANT_KEY}: true on it",
            server=str(name) if name else None,
        )


def num_workers(server_config: Any) -> int:
    """The server's uvicorn workers (``num_workers``, at least 1)."""
    return int(getattr(server_config, "num_workers", None) or 1)


def _is_agent_config(server_config: Any, global_config: Any) -> bool:
    if global_config is None:
        from nemo_gym.global_config import get_global_config_dict

        global_config = get_global_config_dict()
    name = getattr(server_config, "name", None)
    block: Any = global_config.get(str(name)) if name and hasattr(global_config, "get") else None
    return hasattr(block, "keys") and "responses_api_agents" in block.keys()


def is_gym_worker() -> bool:
    """Whether this process is one of the uvicorn workers of a Gym server with ``num_workers > 1``."""
    from nemo_gym.server_utils import is_nemo_gym_fastapi_worker

    return is_nemo_gym_fastapi_worker()


def install_client(server: Any) -> None:
    """Give ``server`` the plugin's server client (same configuration as its current one)."""
    from nemo_gym_checkpoint_plugin._client import CheckpointServerClient

    server.server_client = CheckpointServerClient.from_client(server.server_client)


class RolloutAttribution:
    """Pure ASGI middleware: run a request under Gym's rollout context named by its ``/ng-rollout/<key>`` prefix.

    The scope is never rewritten (agents route the prefixed path themselves); a request
    without the prefix passes untouched at the cost of one ``startswith``.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from nemo_gym.rollout_correlation import ROLLOUT_ID_PATTERN, rollout_context

        path = scope.get("path", "") if scope.get("type") == "http" else ""
        if not path.startswith(_ROLLOUT_PREFIX):
            await self.app(scope, receive, send)
            return
        key = path[len(_ROLLOUT_PREFIX) :].partition("/")[0]
        if not ROLLOUT_ID_PATTERN.match(key):
            await self.app(scope, receive, send)
            return
        with rollout_context(key):
            await self.app(scope, receive, send)


_ROLLOUT_PREFIX = ROLLOUT_PATH_PREFIX


@dataclass(frozen=True)
class Attachment:
    """What ``attach_checkpointing`` installed on one app (kept on ``app.state``)."""

    settings: CheckpointSettings
    kind: str
    instance: str
    control: Any
    gate_counters: Any
    # num_workers > 1: the coordinator (main process, ``_workers.service.CoordinatorService``) or the
    # worker side (a uvicorn worker, ``_workers.attach.WorkerAttachment``); None on a single worker.
    workers: Any = None


def builtin_plugins() -> list[Any]:
    from nemo_gym_checkpoint_plugin.builtin_participants import builtin_plugins as fresh

    return fresh()


def attach_checkpointing(
    server: Any,
    app: Any,
    *,
    settings: CheckpointSettings | None = None,
    token: str | None = None,
    extra_plugins: Iterable[Any] = (),
    builtin: bool = True,
) -> Attachment | None:
    """Install the control routes and the admission gate on ``app`` when checkpointing is enabled.

    ``settings``/``token`` default to ``server_settings(server)``. Returns None (and
    installs nothing) when disabled. Raises ``SettingsError`` for a bad block or an
    unsupported server config (``refuse_unsupported``) and ``RuntimeError`` when ``app``
    already carries an attachment; nothing is installed then.
    ``extra_plugins`` are registered on the plugin manager after the built-ins and the
    entry-point group (tests, embedding code). With ``builtin`` the server's built-in
    participants (``builtin_participants.builtin_plugins``) are registered too, joining
    through ``attach`` as every plugin does.
    """
    if settings is None:
        settings, token = server_settings(server)
    if not settings.enabled:
        return None
    refuse_unsupported(server.config, settings, server.server_client.global_config_dict)
    if token is None:
        try:
            token = settings.resolve_token()
        except SettingsError as exc:
            raise exc.for_server(_server_name(server)) from None
    if getattr(app.state, ATTACHMENT_STATE, None) is not None:
        raise RuntimeError("checkpointing is already attached to this app")

    from nemo_gym_checkpoint_plugin._control import ControlPlane
    from nemo_gym_checkpoint_plugin._gate import install_gate
    from nemo_gym_checkpoint_plugin._routes import attach as attach_routes

    kind = server_kind(type(server))
    instance = str(server.config.name)
    workers = num_workers(server.config)
    if workers > 1 and not is_gym_worker():
        return _attach_coordinator(app, kind=kind, instance=instance, settings=settings, token=token, workers=workers)
    from nemo_gym_checkpoint_plugin._plugins import attach_plugins, make_plugin_manager

    builtins = builtin_plugins() if builtin else []
    plugins = [*builtins, *extra_plugins]
    # Everything that can fail is built before the app is touched: a failure installs nothing.
    pm = make_plugin_manager(plugins)

    dropped = attach_plugins(pm, server=server, app=app, kind=kind, instance=instance, settings=settings)
    if dropped:
        logger.info("checkpoint plugins %s do not apply to %s (%s); unregistered", dropped, instance, kind)
    if workers > 1:
        from nemo_gym_checkpoint_plugin._workers.attach import attach_worker

        worker = attach_worker(app, pm, kind=kind)
        attachment = Attachment(
            settings=settings,
            kind=kind,
            instance=instance,
            control=None,
            gate_counters=worker.gate_counters,
            workers=worker,
        )
        setattr(app.state, ATTACHMENT_STATE, attachment)
        return attachment
    try:
        control = ControlPlane(pm, kind=kind, instance=instance, settings=settings)
    except SettingsError as exc:  # an unknown checkpoint.storage.backend
        raise exc.for_server(instance) from None

    attach_routes(app, control, token)
    # Each plugin's middleware, inside the gate; where an episode begins the marks are checked too.
    pm.hook.serving(app=app, marks=control.marks)
    if kind == "resources":
        from nemo_gym_checkpoint_plugin._seeds import install_seed_hook

        install_seed_hook(app, control.participants)
    if kind == "agent":
        app.add_middleware(RolloutAttribution)
    # Added last, so outermost so far: the gate sees the raw prefixed path before any Gym middleware.
    counters = install_gate(
        app, control.admission, control.marks, run_path="/run" if kind in ("environment", "agent") else None
    )
    control.telemetry.metrics.watch_gate(counters)  # parked requests in the metrics (docs/telemetry.md)
    if kind == "environment":
        from nemo_gym_checkpoint_plugin._explicit_ids import ExplicitAttemptIds

        # Outside the gate: it attributes the decoded attempt (an explicit "<id>-aN" of Gym's typed path).
        app.add_middleware(ExplicitAttemptIds)
    app.router.on_shutdown.append(control.aclose)
    attachment = Attachment(settings=settings, kind=kind, instance=instance, control=control, gate_counters=counters)
    setattr(app.state, ATTACHMENT_STATE, attachment)
    return attachment


def _attach_coordinator(
    app: Any, *, kind: str, instance: str, settings: CheckpointSettings, token: str, workers: int
) -> Attachment:
    """Gym's main process of a server with several workers: only the coordinator, beside uvicorn's supervisor."""
    from nemo_gym_checkpoint_plugin._workers.service import start_coordinator

    try:
        service = start_coordinator(expected=workers, kind=kind, instance=instance, settings=settings, token=token)
    except SettingsError as exc:  # an unknown checkpoint.storage.backend
        raise exc.for_server(instance) from None
    attachment = Attachment(
        settings=settings, kind=kind, instance=instance, control=service.plane, gate_counters=None, workers=service
    )
    setattr(app.state, ATTACHMENT_STATE, attachment)
    return attachment
