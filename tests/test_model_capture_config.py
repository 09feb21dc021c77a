"""With checkpointing on, a model or agent server refuses to start when a token-capturing agent calls a model server
that is not a checkpoint participant (its capture rows would fall outside every checkpoint).

The config is the testing kit's with two chains (``simple_agent -> policy_model`` and
``simple_agent_2 -> policy_model_2``) and Gym's ``token_id_capture`` on for all agents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_attach_inprocess import _app, _build, _server_class

from nemo_gym_checkpoint_plugin._settings import SettingsError
from nemo_gym_checkpoint_plugin.mixin import exit_on_bad_settings
from nemo_gym_checkpoint_plugin.testing.gym_config import (
    AGENT,
    MODEL,
    TOKEN_ENV,
    WRAP_ENTRYPOINT,
    build_gym_config,
    replica_name,
    server_location,
)
from nemo_gym_checkpoint_plugin.wrap import derive_checkpointable

OTHER_MODEL, OTHER_AGENT = replica_name(MODEL, 2), replica_name(AGENT, 2)
CHECKPOINT = {"enabled": True, "control_auth_token_env": TOKEN_ENV}


@pytest.fixture(autouse=True)
def _token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "capture-config-token")


def _config(tmp_path: Path, *, all_agents: bool = True, **build: Any) -> Any:
    capture = {"enabled": True, "all_agents": all_agents, "dir": str(tmp_path / "captures")}
    return build_gym_config(
        20000, tmp_path, checkpoint=CHECKPOINT, replicas=2, gym_settings={"token_id_capture": capture}, **build
    )


def _start(config: Any, name: str) -> Any:
    """Build ``name`` as the wrapper would run it, through to its app (where the attachment checks)."""
    server = _build(derive_checkpointable(_server_class(config, name)), config, name)
    return _app(server)


@pytest.mark.parametrize("name", [MODEL, AGENT])
def test_a_server_refuses_when_a_capturing_agent_calls_a_model_server_outside_the_checkpoint(
    tmp_path: Path, name: str
) -> None:
    config = _config(tmp_path)  # the models run app.py: neither is a participant (but the one starting)
    with pytest.raises(SettingsError) as refused:
        _start(config, name)
    message = str(refused.value)
    assert f"agent {OTHER_AGENT!r} calls model server {OTHER_MODEL!r}" in message, message
    assert "checkpoint_participant: true" in message and "-mnemo_gym_checkpoint_plugin.wrap" in message


def test_the_wrapper_exits_2_before_anything_is_built_naming_the_agent_and_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path)
    server_config = _build(_server_class(config, MODEL), config, MODEL).config
    with pytest.raises(SystemExit) as exited:
        exit_on_bad_settings(global_config=config, server_config=server_config)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"server {MODEL!r}" in err and OTHER_AGENT in err and OTHER_MODEL in err, err


@pytest.mark.parametrize(
    "how",
    ["wrapped", "declared", "no capturing agent"],
)
def test_every_model_server_a_participant_or_no_capture_starts(tmp_path: Path, how: str) -> None:
    if how == "wrapped":
        config = _config(tmp_path, entrypoints={MODEL: WRAP_ENTRYPOINT})
    elif how == "declared":
        config = _config(tmp_path)
        for model in (MODEL, OTHER_MODEL):
            server_location(config, model)[2]["checkpoint_participant"] = True
    else:
        config = _config(tmp_path, all_agents=False)
    for name in (MODEL, AGENT):
        assert _start(config, name) is not None
