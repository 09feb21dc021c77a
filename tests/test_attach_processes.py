"""The attachment in real server processes: the wheel's servers run through the wrapper entrypoint."""

from __future__ import annotations

import asyncio
import importlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from omegaconf import OmegaConf

from nemo_gym_checkpoint_plugin.testing.deployment import rollout_body
from nemo_gym_checkpoint_plugin.testing.gym_config import (
    DEFAULT_CHECKPOINT_BLOCK,
    GYM_SERVERS,
    RESOURCES,
    TOKEN_ENV,
    WRAP_ENTRYPOINT,
    build_gym_config,
    server_location,
    wrapped_entrypoints,
)
from nemo_gym_checkpoint_plugin.testing.harness import (
    HARNESS_TOKEN,
    GymHarness,
    free_port_base,
    send_rollout,
    send_wave,
)
from nemo_gym_checkpoint_plugin.wrap import find_server_class, relative_entrypoint

pytestmark = pytest.mark.slow

CONTROL = "/ng-control/v1/checkpoint"
STATUS = f"{CONTROL}/status"
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


async def test_disabled_wrapped_servers_reply_as_unwrapped_gym_and_install_nothing(gym_deployment_factory) -> None:
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


async def test_enabled_wrapped_servers_are_participants_and_still_serve(gym_deployment_factory) -> None:
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


async def test_retiring_an_episode_in_flight_ends_its_run_with_a_cancelled_failure(gym_deployment_factory) -> None:
    harness: GymHarness = gym_deployment_factory(checkpoint=DEFAULT_CHECKPOINT_BLOCK, entrypoints=wrapped_entrypoints())
    env = harness.env_url
    # Hold the rollout at its agent step (the model's second call), so the episode is in flight.
    await harness.fake.hold(match="(rollout retire-me)", count=1, step=1)
    run = asyncio.create_task(send_rollout(env, "retire-me"))
    auth = {"Authorization": f"Bearer {HARNESS_TOKEN}"}
    episode = {"rollout_id": "retire-me", "attempt": 0}
    try:
        await harness.fake.wait_for(lambda s: s["held"] == 1, timeout=60, what="the held agent step")
        async with httpx.AsyncClient(base_url=env, timeout=30, trust_env=False) as client:
            retired = await client.post(
                f"{CONTROL}/retire",
                headers=auth,
                json={"checkpoint_id": "retire-live", "deadline_ts": time.time() + 30, "episode_ids": [episode]},
            )
            assert retired.status_code == 200, retired.text
            assert retired.json() == {"retired_count": 1}
            # The attempt's /run answers (not a dropped connection): a non-terminal failure naming the retire.
            reply = await asyncio.wait_for(run, timeout=30)
            assert reply["episode_id"] == episode
            assert reply["failure"]["failure_kind"] == "cancelled"
            assert reply["failure"]["terminal"] is False
            assert "retired by the controller" in reply["failure"]["failure_reason"]
            # The book no longer holds it, and the attempt is refused at the gate from now on.
            status = (await client.get(f"{CONTROL}/status", headers=auth)).json()
            assert status["episodes"] == 0 and status["retired_rollouts"] == 1, status
            again = await client.post("/run", json=rollout_body("retire-me"))
            assert again.status_code == 409 and again.json()["error"]["code"] == "stale_attempt"
    finally:
        await harness.fake.release(match="(rollout retire-me)")
        if not run.done():
            run.cancel()


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
            {TOKEN_ENV: "attach-processes-token"},
            "checkpoint.bogus_key",
        ),
        (
            {"enabled": True, "lease_grace_seconds": 0, "control_auth_token": "attach-processes-token"},
            {},
            "checkpoint.lease_grace_seconds",
        ),
        (DEFAULT_CHECKPOINT_BLOCK, {}, "checkpoint.control_auth_token_env"),
        (
            {**DEFAULT_CHECKPOINT_BLOCK, "enabeld": True},
            {TOKEN_ENV: "attach-processes-token"},
            "checkpoint.enabeld: unknown key (did you mean 'enabled'?)",
        ),
        (
            {**DEFAULT_CHECKPOINT_BLOCK, "storage": {"backend": "s3"}},
            {TOKEN_ENV: "attach-processes-token"},
            "checkpoint.storage.backend: no storage backend named 's3'; the backends available: 'fsspec', 'local'",
        ),
    ],
)
def test_a_bad_block_makes_the_wrapped_server_refuse_to_start(
    tmp_path: Path, checkpoint: dict, env: dict[str, str], key: str
) -> None:
    done = _start_wrapped_resources(tmp_path, checkpoint, env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "refusing to start" in done.stderr and key in done.stderr, done.stderr[-2000:]
    # The message names the server, and it is the only thing said: no traceback.
    assert f"server {RESOURCES!r}: " in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "Uvicorn running" not in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("checkpoint", "env", "token", "told"),
    [
        # A 1-character token used to start a server; a non-ASCII one started it and then refused every call.
        (
            DEFAULT_CHECKPOINT_BLOCK,
            {TOKEN_ENV: "Q"},
            "Q",
            f"the control token from the variable {TOKEN_ENV} (checkpoint.control_auth_token_env) is 1 characters long",
        ),
        (
            {"enabled": True, "control_auth_token": "short-but-15-ch"},
            {},
            "short-but-15-ch",
            "the control token from checkpoint.control_auth_token is 15 characters long",
        ),
        (
            DEFAULT_CHECKPOINT_BLOCK,
            {TOKEN_ENV: "jeton-de-contrôle-0123456789"},
            "jeton-de-contrôle-0123456789",
            f"the control token from the variable {TOKEN_ENV} (checkpoint.control_auth_token_env) holds a character "
            "outside printable ASCII or a space",
        ),
    ],
)
def test_a_token_breaking_the_rule_stops_the_server_naming_the_rule_and_source(
    tmp_path: Path, checkpoint: dict, env: dict[str, str], token: str, told: str
) -> None:
    done = _start_wrapped_resources(tmp_path, checkpoint, env)
    assert done.returncode == 2, done.stderr[-2000:]
    said = done.stdout + done.stderr
    assert (
        f"server {RESOURCES!r}: {told} (the token must be at least 16 characters of printable ASCII, without "
        "spaces)" in done.stderr
    ), done.stderr[-2000:]
    assert "Uvicorn running" not in said and "Traceback" not in said
    if len(token) > 1:  # a 1-character token is in any text; the longer ones must not be told
        assert token not in said


@pytest.mark.parametrize("pasted", ["sk-live-9f8e7d6c5b4a3210", "TokenThatLooksLikeAName42"])
def test_a_token_pasted_as_the_variable_name_is_never_echoed(tmp_path: Path, pasted: str) -> None:
    done = _start_wrapped_resources(tmp_path, {"enabled": True, "control_auth_token_env": pasted}, {})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "checkpoint.control_auth_token_env" in done.stderr, done.stderr[-2000:]
    assert pasted not in done.stdout + done.stderr
