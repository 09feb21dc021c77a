"""``expose_tools_over_mcp`` with checkpointing: refused clearly at startup while enabled, untouched while disabled.

Gym's MCP auto-exposure (run after ``setup_webserver``) dispatches tool calls directly to the
handlers and raises ``ValueError`` on any non-Gym middleware, such as the admission gate. The
attachment refuses the combination first, naming both keys, before anything is installed.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from nemo_gym.mcp_auto_exposure import install_auto_exposure, maybe_auto_expose
from nemo_gym.server_utils import ServerClient
from omegaconf import OmegaConf
from test_attach_inprocess import ENABLED, _build, _config, _middleware, _paths, _server_class

from nemo_gym_checkpoint_plugin._attach import ATTACHMENT_STATE, attach_checkpointing, refuse_unsupported
from nemo_gym_checkpoint_plugin._settings import SettingsError, load_settings
from nemo_gym_checkpoint_plugin.mixin import exit_on_bad_settings
from nemo_gym_checkpoint_plugin.testing.gym_config import (
    RESOURCES,
    TOKEN_ENV,
    WRAP_ENTRYPOINT,
    build_gym_config,
    server_location,
)
from nemo_gym_checkpoint_plugin.testing.harness import free_port_base
from nemo_gym_checkpoint_plugin.wrap import derive_checkpointable

TOKEN = "mcp-attach-test-token"
BOTH_KEYS = r"expose_tools_over_mcp.*checkpoint\.enabled.*not supported yet"


@pytest.fixture(autouse=True)
def _token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)


def _mcp_server(tmp_path: Path, checkpoint: Any, *, wrapped: bool = True) -> Any:
    config = _config(tmp_path, checkpoint)
    base = _server_class(config, RESOURCES)
    cls = derive_checkpointable(base) if wrapped else base
    return _build(cls, config, RESOURCES, expose_tools_over_mcp=True)


async def test_without_the_refusal_gym_fails_on_the_gate_with_its_own_error(tmp_path: Path) -> None:
    # The failure being pre-empted: once the gate is installed, Gym's exposure (what run_webserver
    # calls for a server with the flag) rejects it as foreign middleware, never naming the block.
    config = _config(tmp_path, ENABLED)
    server = _build(derive_checkpointable(_server_class(config, RESOURCES)), config, RESOURCES)
    app = server.setup_webserver()
    assert getattr(app.state, ATTACHMENT_STATE, None) is not None
    with pytest.raises(ValueError, match="non-Gym middleware.*AdmissionGate") as caught:
        install_auto_exposure(server, app)
    assert "checkpoint.enabled" not in str(caught.value)
    await app.state.checkpoint_control.aclose()


def test_the_mixin_refuses_naming_both_keys_before_installing_anything(tmp_path: Path) -> None:
    server = _mcp_server(tmp_path, ENABLED)
    with pytest.raises(SettingsError, match=BOTH_KEYS):
        server.setup_webserver()
    # Refused before the client swap: the server is as Gym built it.
    assert type(server.server_client) is ServerClient


def test_attach_refuses_naming_both_keys_and_leaves_the_app_untouched(tmp_path: Path) -> None:
    server = _mcp_server(tmp_path, ENABLED, wrapped=False)
    app = server.setup_webserver()
    paths, middleware = _paths(app), _middleware(app)
    with pytest.raises(SettingsError, match=BOTH_KEYS) as caught:
        attach_checkpointing(server, app)
    assert repr(RESOURCES) in str(caught.value)  # names the server too
    assert _paths(app) == paths and _middleware(app) == middleware
    assert getattr(app.state, ATTACHMENT_STATE, None) is None
    # Gym's own exposure still works on the untouched app.
    assert maybe_auto_expose(server, app)


def test_startup_check_exits_2_with_a_message_naming_both_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = _mcp_server(tmp_path, ENABLED)
    with pytest.raises(SystemExit) as exited:
        exit_on_bad_settings(server.server_client.global_config_dict, server_config=server.config)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("nemo-gym-checkpoint: refusing to start:")
    assert "expose_tools_over_mcp" in err and "checkpoint.enabled" in err and "not supported yet" in err


@pytest.mark.parametrize("checkpoint", [None, {"enabled": False}])
def test_disabled_with_mcp_attaches_nothing_and_gym_exposes_the_tools(
    tmp_path: Path, checkpoint: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    server = _mcp_server(tmp_path, checkpoint)
    plain = _mcp_server(tmp_path, checkpoint, wrapped=False)
    exit_on_bad_settings(server.server_client.global_config_dict, server_config=server.config)  # no exit
    refuse_unsupported(server.config, load_settings(server.server_client.global_config_dict)[0])
    app, plain_app = server.setup_webserver(), plain.setup_webserver()
    assert getattr(app.state, ATTACHMENT_STATE, None) is None
    assert type(server.server_client) is ServerClient
    assert _paths(app) == _paths(plain_app) and _middleware(app) == _middleware(plain_app)
    assert sorted(maybe_auto_expose(server, app)) == sorted(maybe_auto_expose(plain, plain_app))
    assert capsys.readouterr().err == ""


async def test_enabled_without_mcp_still_attaches(tmp_path: Path) -> None:
    config = _config(tmp_path, ENABLED)
    server = _build(derive_checkpointable(_server_class(config, RESOURCES)), config, RESOURCES)
    assert server.config.expose_tools_over_mcp is False
    app = server.setup_webserver()
    assert getattr(app.state, ATTACHMENT_STATE, None) is not None
    await app.state.checkpoint_control.aclose()


@pytest.mark.slow
def test_the_wrapped_server_process_exits_2_naming_both_keys(tmp_path: Path) -> None:
    config = build_gym_config(free_port_base(), tmp_path, checkpoint=ENABLED)
    server_location(config, RESOURCES)[2]["entrypoint"] = WRAP_ENTRYPOINT
    server_location(config, RESOURCES)[2]["expose_tools_over_mcp"] = True
    server_dir = Path(importlib.import_module(f"resources_servers.{RESOURCES}.app").__file__).parent
    done = subprocess.run(
        [sys.executable, "-m", WRAP_ENTRYPOINT],
        cwd=server_dir,
        env={
            **os.environ,
            TOKEN_ENV: TOKEN,
            "NEMO_GYM_CONFIG_DICT": OmegaConf.to_yaml(config),
            "NEMO_GYM_CONFIG_PATH": RESOURCES,
            "RAY_USAGE_STATS_ENABLED": "0",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "refusing to start" in done.stderr, done.stderr[-2000:]
    assert "expose_tools_over_mcp" in done.stderr and "checkpoint.enabled" in done.stderr
    assert "non-Gym middleware" not in done.stderr and "Uvicorn running" not in done.stdout + done.stderr
