"""The attachment in real server processes: the wheel's servers run through the wrapper entrypoint."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from gym_harness import (
    HARNESS_TOKEN,
    GymHarness,
    free_port_base,
    gym_deployment_factory_fixture,  # noqa: F401 - provides the gym_deployment_factory fixture
    send_wave,
)
from omegaconf import OmegaConf

from nemo_gym_checkpoint_plugin.gym_config import (
    DEFAULT_CHECKPOINT_BLOCK,
    GYM_SERVERS,
    RESOURCES,
    TOKEN_ENV,
    WRAP_ENTRYPOINT,
    build_gym_config,
    server_location,
    wrapped_entrypoints,
)
from nemo_gym_checkpoint_plugin.wrap import find_server_class, relative_entrypoint

pytestmark = pytest.mark.slow

STATUS = "/ng-control/v1/checkpoint/status"
KINDS = {"policy_model": "model", "simple_agent": "agent", RESOURCES: "resources", "single_agent_turn": "environment"}
# Values that differ run to run: generated ids and clocks. Everything else must match exactly.
_VOLATILE_KEYS = {"id", "created_at", "call_id", "response_id", "completed_at"}
_HEX_ID = re.compile(r"[0-9a-f]{16,}")


def _resources_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec(f"resources_servers.{RESOURCES}.app")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent


def _normalized(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: "<volatile>" if k in _VOLATILE_KEYS else _normalized(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalized(v) for v in value]
    if isinstance(value, str):
        return _HEX_ID.sub("<hex>", value)
    return value


def _http() -> httpx.Client:
    return httpx.Client(timeout=10.0, trust_env=False)


async def test_disabled_wrapped_servers_reply_as_unwrapped_gym_and_install_nothing(gym_deployment_factory) -> None:  # noqa: F811
    ids = [f"same-{i}" for i in range(6)]
    plain = gym_deployment_factory(checkpoint=None)
    plain_replies = await send_wave(plain.env_url, ids)
    plain.stop()
    # The resources server is named by path, as Gym's RunHelper needs; the others as a module.
    entrypoints = {**wrapped_entrypoints(), RESOURCES: relative_entrypoint(_resources_dir())}
    wrapped = gym_deployment_factory(checkpoint={"enabled": False}, entrypoints=entrypoints)
    wrapped_replies = await send_wave(wrapped.env_url, ids)
    assert all(reply["result"]["reward"] == 1.0 for reply in wrapped_replies)
    assert [_normalized(r) for r in wrapped_replies] == [_normalized(r) for r in plain_replies]
    with _http() as http:
        for name in GYM_SERVERS:
            reply = http.get(wrapped.urls[name] + STATUS, headers={"Authorization": f"Bearer {HARNESS_TOKEN}"})
            assert reply.status_code == 404, (name, reply.text)


async def test_enabled_wrapped_servers_are_participants_and_still_serve(gym_deployment_factory) -> None:  # noqa: F811
    harness: GymHarness = gym_deployment_factory(checkpoint=DEFAULT_CHECKPOINT_BLOCK, entrypoints=wrapped_entrypoints())
    replies = await send_wave(harness.env_url, [f"on-{i}" for i in range(6)])
    assert [reply["result"]["reward"] for reply in replies] == [1.0] * 6
    with _http() as http:
        for name in GYM_SERVERS:
            url = harness.urls[name] + STATUS
            ok = http.get(url, headers={"Authorization": f"Bearer {HARNESS_TOKEN}"})
            assert ok.status_code == 200, (name, ok.text)
            assert (ok.json()["kind"], ok.json()["instance"], ok.json()["phase"]) == (KINDS[name], name, "idle")
            refused = http.get(url)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
        # Gym's session cookie keeps the unwrapped class's name.
        unwrapped = find_server_class(importlib.import_module(f"resources_servers.{RESOURCES}.app"))
        seeded = http.post(harness.urls[RESOURCES] + "/seed_session", json={})
        assert list(seeded.cookies.keys()) == [f"{unwrapped.__name__}___{RESOURCES}"]


def _start_wrapped_resources(tmp_path: Path, checkpoint: dict, env: dict[str, str]) -> subprocess.CompletedProcess:
    config = build_gym_config(free_port_base(), tmp_path, checkpoint=checkpoint)
    server_location(config, RESOURCES)[2]["entrypoint"] = WRAP_ENTRYPOINT
    clean = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    return subprocess.run(
        [sys.executable, "-m", WRAP_ENTRYPOINT],
        cwd=_resources_dir(),
        env={
            **clean,
            **env,
            "NEMO_GYM_CONFIG_DICT": OmegaConf.to_yaml(config),
            "NEMO_GYM_CONFIG_PATH": RESOURCES,
            "RAY_USAGE_STATS_ENABLED": "0",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("checkpoint", "env", "key"),
    [
        (
            {"enabled": True, "control_auth_token_env": TOKEN_ENV, "bogus_key": 1},
            {TOKEN_ENV: "t"},
            "checkpoint.bogus_key",
        ),
        ({"enabled": True, "lease_grace_seconds": 0, "control_auth_token": "t"}, {}, "checkpoint.lease_grace_seconds"),
        (DEFAULT_CHECKPOINT_BLOCK, {}, "checkpoint.control_auth_token_env"),
    ],
)
def test_a_bad_block_makes_the_wrapped_server_refuse_to_start(
    tmp_path: Path, checkpoint: dict, env: dict[str, str], key: str
) -> None:
    done = _start_wrapped_resources(tmp_path, checkpoint, env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "refusing to start" in done.stderr and key in done.stderr, done.stderr[-2000:]
    assert "Uvicorn running" not in done.stdout + done.stderr
