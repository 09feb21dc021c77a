"""The attachment on the wheel's real server classes, in process (apps built, served through ASGI).

Each server is built as Gym's ``run_webserver`` builds it (config from the global config,
``setup_webserver``, then liveness), with and without ``CheckpointMixin``.
"""

from __future__ import annotations

import asyncio
import importlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from nemo_gym.server_utils import BaseServerConfig, ServerClient, _server_uses_ray
from omegaconf import OmegaConf

from nemo_gym_checkpoint_plugin._attach import ATTACHMENT_STATE, RolloutAttribution, attach_checkpointing
from nemo_gym_checkpoint_plugin._client import CheckpointServerClient
from nemo_gym_checkpoint_plugin._explicit_ids import ExplicitAttemptIds
from nemo_gym_checkpoint_plugin._gate import AdmissionGate
from nemo_gym_checkpoint_plugin._markers import hookimpl
from nemo_gym_checkpoint_plugin._settings import SettingsError
from nemo_gym_checkpoint_plugin.testing.gym_config import (
    AGENT,
    ENVIRONMENT,
    GYM_SERVERS,
    MODEL,
    RESOURCES,
    TOKEN_ENV,
    build_gym_config,
    server_location,
)
from nemo_gym_checkpoint_plugin.wrap import derive_checkpointable, find_server_class

TOKEN = "in-process-token"
ENABLED = {"enabled": True, "control_auth_token_env": TOKEN_ENV}
KINDS = {MODEL: "model", AGENT: "agent", RESOURCES: "resources", ENVIRONMENT: "environment"}


def _server_class(config: Any, name: str) -> type:
    server_type, implementation, _ = server_location(config, name)
    return find_server_class(importlib.import_module(f"{server_type}.{implementation}.app"))


def _build(server_class: type, config: Any, name: str, **overrides: Any) -> Any:
    inner = OmegaConf.to_container(server_location(config, name)[2], resolve=True)
    config_cls = server_class.model_fields["config"].annotation
    client = ServerClient(head_server_config=BaseServerConfig(**config.head_server), global_config_dict=config)
    return server_class(config=config_cls.model_validate({**inner, **overrides, "name": name}), server_client=client)


def _config(tmp_path: Path, checkpoint: Mapping[str, Any] | None) -> Any:
    return build_gym_config(20000, tmp_path, checkpoint=checkpoint)


def _app(server: Any) -> Any:
    app = server.setup_webserver()
    server.setup_liveness(app)
    return app


def _paths(app: Any) -> set[str]:
    return {route.path for route in app.routes}


def _middleware(app: Any) -> list[type]:
    return [m.cls for m in app.user_middleware]


def _asgi(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=10.0)


@pytest.fixture(autouse=True)
def _token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)


@pytest.mark.parametrize("checkpoint", [None, {"enabled": False}, {"enabled": False, "control_auth_token_env": "X"}])
@pytest.mark.parametrize("name", GYM_SERVERS)
def test_disabled_installs_nothing(tmp_path: Path, name: str, checkpoint: Mapping[str, Any] | None) -> None:
    config = _config(tmp_path, checkpoint)
    base = _server_class(config, name)
    plain, wrapped = _build(base, config, name), _build(derive_checkpointable(base), config, name)
    plain_app, wrapped_app = _app(plain), _app(wrapped)
    assert _paths(wrapped_app) == _paths(plain_app)
    assert not any(path.startswith("/ng-control") for path in _paths(wrapped_app))
    assert _middleware(wrapped_app) == _middleware(plain_app)
    assert AdmissionGate not in _middleware(wrapped_app) and RolloutAttribution not in _middleware(wrapped_app)
    assert type(wrapped.server_client) is ServerClient
    assert getattr(wrapped_app.state, ATTACHMENT_STATE, None) is None


@pytest.mark.parametrize("name", GYM_SERVERS)
async def test_enabled_serves_control_routes_behind_the_token_and_gates_outermost(tmp_path: Path, name: str) -> None:
    config = _config(tmp_path, ENABLED)
    server = _build(derive_checkpointable(_server_class(config, name)), config, name)
    app = _app(server)
    # Outermost so far: Gym's exception and cancellation middleware are added after this by run_webserver.
    # On an environment only the explicit-id decoding is outside it, so the gate sees the decoded attempt.
    outer = [ExplicitAttemptIds, AdmissionGate] if KINDS[name] == "environment" else [AdmissionGate]
    assert _middleware(app)[: len(outer)] == outer
    assert (RolloutAttribution in _middleware(app)) is (name == AGENT)
    assert isinstance(server.server_client, CheckpointServerClient)
    async with _asgi(app) as http:
        status = await http.get("/ng-control/v1/checkpoint/status", headers={"Authorization": f"Bearer {TOKEN}"})
        refused = await http.get("/ng-control/v1/checkpoint/status", headers={"Authorization": "Bearer nope"})
    assert status.status_code == 200, status.text
    assert status.json()["kind"] == KINDS[name] and status.json()["instance"] == name
    assert status.json()["phase"] == "idle" and "unmanaged" not in status.json()
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
    await app.state.checkpoint_control.aclose()


@pytest.mark.parametrize("checkpoint", [None, {"enabled": False}, ENABLED])
@pytest.mark.parametrize("name", GYM_SERVERS)
async def test_checkpoint_metrics_exist_only_when_enabled(
    tmp_path: Path, name: str, checkpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/telemetry.md: with checkpointing off no registry is built and no metrics route is served.
    from nemo_gym_checkpoint_plugin._telemetry import metrics

    built: list[Any] = []
    original = metrics.ServerMetrics.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(metrics.ServerMetrics, "__init__", counting)
    config = _config(tmp_path, checkpoint)
    app = _app(_build(derive_checkpointable(_server_class(config, name)), config, name))
    enabled = checkpoint is ENABLED
    assert len(built) == (1 if enabled else 0)
    async with _asgi(app) as http:
        scrape = await http.get("/ng-control/v1/checkpoint/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        refused = await http.get("/ng-control/v1/checkpoint/metrics")
    if not enabled:
        assert scrape.status_code == refused.status_code == 404
        return
    assert scrape.status_code == 200 and refused.status_code == 401
    assert "gym_checkpoint_duration_seconds" in scrape.text and "gym_checkpoint_completed_total 0.0" in scrape.text
    # The gate's counters are connected: its parked requests are read at scrape time.
    assert built[0].gate is getattr(app.state, ATTACHMENT_STATE).gate_counters
    assert "gym_checkpoint_held_responses 0.0" in scrape.text
    await app.state.checkpoint_control.aclose()


@pytest.mark.parametrize("checkpoint", [None, ENABLED])
@pytest.mark.parametrize("name", GYM_SERVERS)
def test_the_session_cookie_is_the_unwrapped_servers(tmp_path: Path, name: str, checkpoint: Any) -> None:
    config = _config(tmp_path, checkpoint)
    base = _server_class(config, name)
    derived = derive_checkpointable(base)
    assert derived is not base and derived.__name__ == base.__name__
    plain, wrapped = _build(base, config, name), _build(derived, config, name)
    assert wrapped.get_session_middleware_key() == plain.get_session_middleware_key() == f"{base.__name__}___{name}"


async def test_a_resources_seed_sets_the_same_cookie_name_wrapped_or_not(tmp_path: Path) -> None:
    config = _config(tmp_path, ENABLED)
    base = _server_class(config, RESOURCES)
    names = []
    for cls in (base, derive_checkpointable(base)):
        app = _app(_build(cls, config, RESOURCES))
        async with _asgi(app) as http:
            reply = await http.post("/seed_session", json={})
        assert reply.status_code == 200, reply.text
        names.append(sorted(reply.cookies.keys()))
        control = getattr(app.state, "checkpoint_control", None)
        if control is not None:
            await control.aclose()
    assert names[0] == names[1] == [f"{base.__name__}___{RESOURCES}"]


async def test_health_routes_pass_while_admission_is_closed(tmp_path: Path) -> None:
    config = _config(tmp_path, ENABLED)
    app = _app(_build(derive_checkpointable(_server_class(config, RESOURCES)), config, RESOURCES))
    control = app.state.checkpoint_control
    control.admission.close()
    async with _asgi(app) as http:
        for path in ("/", "/health", "/healthz", "/livez", "/readyz"):
            reply = await asyncio.wait_for(http.get(path), 10.0)
            assert reply.status_code == 200, path
        parked = asyncio.ensure_future(http.post("/verify", json={}))
        # A data request parks at the gate while admission is closed: it has not been answered.
        await asyncio.sleep(0.2)  # wait-ok: proving a request stays parked needs a bounded idle period
        assert not parked.done()
        control.admission.open()
        await asyncio.wait_for(parked, 10.0)
    await control.aclose()


@pytest.mark.parametrize("name", GYM_SERVERS)
def test_ray_is_never_started(tmp_path: Path, name: str) -> None:
    derived = derive_checkpointable(_server_class(_config(tmp_path, None), name))
    assert derived.ray_enabled is False
    assert _server_uses_ray(derived) is False


def test_a_class_declaring_ray_keeps_its_declaration(tmp_path: Path) -> None:
    base = _server_class(_config(tmp_path, None), RESOURCES)
    needs_ray = type(base.__name__, (base,), {"__module__": base.__module__, "ray_enabled": True})
    assert derive_checkpointable(needs_ray).ray_enabled is True


@pytest.mark.parametrize(
    "checkpoint", [{"enabled": True, "bogus_key": 1}, {"enabled": True, "lease_grace_seconds": -1}]
)
def test_a_bad_block_raises_naming_the_key_and_installs_nothing(tmp_path: Path, checkpoint: dict) -> None:
    config = _config(tmp_path, checkpoint)
    server = _build(derive_checkpointable(_server_class(config, RESOURCES)), config, RESOURCES)
    key = next(k for k in checkpoint if k != "enabled")
    with pytest.raises(SettingsError, match=f"checkpoint.{key}"):
        server.setup_webserver()
    assert type(server.server_client) is ServerClient


def test_enabled_without_the_token_variable_raises_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV)
    config = _config(tmp_path, ENABLED)
    server = _build(derive_checkpointable(_server_class(config, RESOURCES)), config, RESOURCES)
    with pytest.raises(SettingsError, match="checkpoint.control_auth_token_env"):
        server.setup_webserver()


@pytest.mark.parametrize(
    ("checkpoint", "key"),
    [
        ({**ENABLED, "enabeld": True}, "checkpoint.enabeld"),
        ({**ENABLED, "storage": {"backend": "s3"}}, "checkpoint.storage.backend"),
        ({"enabled": True, "control_auth_token_env": "UNSET_VARIABLE_XYZ"}, "checkpoint.control_auth_token_env"),
    ],
)
def test_a_refusal_at_setup_names_the_server(tmp_path: Path, checkpoint: dict, key: str) -> None:
    config = _config(tmp_path, checkpoint)
    server = _build(derive_checkpointable(_server_class(config, RESOURCES)), config, RESOURCES)
    with pytest.raises(SettingsError) as refused:
        server.setup_webserver()
    assert str(refused.value).startswith(f"server {RESOURCES!r}: ") and key in str(refused.value)
    assert str(refused.value).count(RESOURCES) == 1


def test_an_unknown_backend_installs_nothing(tmp_path: Path) -> None:
    from fastapi import FastAPI

    config = _config(tmp_path, {**ENABLED, "storage": {"backend": "s3"}})
    server = _build(derive_checkpointable(_server_class(config, RESOURCES)), config, RESOURCES)
    app = FastAPI()
    with pytest.raises(SettingsError, match="the backends available: 'fsspec', 'local'"):
        attach_checkpointing(server, app)
    assert getattr(app.state, ATTACHMENT_STATE, None) is None
    assert not any(path.startswith("/ng-control") for path in _paths(app)) and _middleware(app) == []


async def test_attaching_twice_is_refused(tmp_path: Path) -> None:
    config = _config(tmp_path, ENABLED)
    server = _build(derive_checkpointable(_server_class(config, RESOURCES)), config, RESOURCES)
    app = server.setup_webserver()
    with pytest.raises(RuntimeError, match="already attached"):
        attach_checkpointing(server, app)
    await app.state.checkpoint_control.aclose()


def test_a_multi_worker_main_process_runs_only_the_coordinator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nemo_gym_checkpoint_plugin._workers.fanout import WorkersParticipant
    from nemo_gym_checkpoint_plugin._workers.service import SOCKET_ENV

    monkeypatch.delenv(SOCKET_ENV, raising=False)
    config = _config(tmp_path, ENABLED)
    server = _build(derive_checkpointable(_server_class(config, RESOURCES)), config, RESOURCES, num_workers=2)
    app = _app(server)
    attachment = getattr(app.state, ATTACHMENT_STATE)
    service = attachment.workers
    try:
        # The app Gym's main process builds is never served: nothing is installed on it.
        assert AdmissionGate not in _middleware(app) and "/ng-control/v1/checkpoint/status" not in _paths(app)
        assert os.environ[SOCKET_ENV] == service.socket_path and os.path.exists(service.socket_path)
        plane = attachment.control
        participants = [p for _, p in plane.pm.list_name_plugin() if hasattr(p, "export")]
        assert [type(p) for p in participants] == [WorkersParticipant]
        status = service.call(plane.status())
        assert status["workers"] == {"expected": 2, "connected": [], "left": []}
        assert status["report"]["worker_blockers"] == [
            "worker not registered (0 of 2), #1",
            "worker not registered (0 of 2), #2",
        ]
    finally:
        service.call(plane.aclose())
        service.call(service.coordinator.aclose())
        service.runtime.remove()


def test_an_agent_with_several_workers_is_refused_naming_the_key(tmp_path: Path) -> None:
    config = _config(tmp_path, ENABLED)
    server = _build(derive_checkpointable(_server_class(config, AGENT)), config, AGENT, num_workers=2)
    with pytest.raises(SettingsError, match="num_workers: 2 on an agent server"):
        server.setup_webserver()


@pytest.mark.parametrize("checkpoint", [None, ENABLED])
def test_an_agent_names_the_rollout_of_a_plain_run_body_only_when_enabled(tmp_path: Path, checkpoint: Any) -> None:
    config = _config(tmp_path, checkpoint)
    base = _server_class(config, AGENT)
    server = _build(derive_checkpointable(base), config, AGENT)
    app = server.setup_webserver()
    body = {"responses_create_params": {"input": "hi"}, "_ng_rollout_id": "task-7", "_ng_attempt_index": 2}
    assert _build(base, config, AGENT).rollout_id_from_run(body) is None  # Gym's own, observability off
    assert server.rollout_id_from_run(body) == ("task-7-a2" if checkpoint else None)
    control = getattr(app.state, "checkpoint_control", None)
    if control is not None:
        asyncio.run(control.aclose())


class _Inner:
    """A do-nothing ASGI middleware a plugin adds in ``serving``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


class _Joiner:
    def __init__(self, applies: bool) -> None:
        self.applies = applies
        self.served: list[tuple[Any, Any]] = []

    @hookimpl
    def attach(self, kind: str) -> bool:
        return self.applies

    @hookimpl
    def serving(self, app: Any, marks: Any) -> None:
        self.served.append((app, marks))
        app.add_middleware(_Inner)


async def test_hook_serving_runs_once_on_each_kept_plugin_with_the_marks_inside_the_gate(tmp_path: Path) -> None:
    config = _config(tmp_path, ENABLED)
    server = _build(_server_class(config, MODEL), config, MODEL)
    app = server.setup_webserver()
    kept, dropped = _Joiner(True), _Joiner(False)
    attachment = attach_checkpointing(server, app, extra_plugins=[kept, dropped])
    assert attachment is not None
    assert kept.served == [(app, attachment.control.marks)] and dropped.served == []
    # Starlette lists middleware outermost first: what serving added runs inside the gate.
    assert _middleware(app).index(AdmissionGate) < _middleware(app).index(_Inner)
    await attachment.control.aclose()


# The built-in participants each server keeps after every one of them answered ``attach``.
_KEPT = {
    MODEL: {"ModelCalls"},
    AGENT: {"SimpleAgentSessions", "UncapturedRuns"},
    RESOURCES: {"ResourcesSessions"},
    ENVIRONMENT: {"SingleAgentTurnBook"},
}


@pytest.mark.parametrize("name", GYM_SERVERS)
async def test_the_built_in_participants_join_through_attach(tmp_path: Path, name: str) -> None:
    from nemo_gym_checkpoint_plugin.builtin_participants import builtin_plugins

    config = _config(tmp_path, ENABLED)
    server = _build(derive_checkpointable(_server_class(config, name)), config, name)
    app = _app(server)
    control = app.state.checkpoint_control
    builtin_names = {type(plugin).__name__ for plugin in builtin_plugins()}
    kept = {type(p).__name__ for p in control.pm.get_plugins()} & builtin_names
    assert kept == _KEPT[name]
    await control.aclose()
