"""Episodes that start over after a crash, as the operator sees them on real Gym servers.

- A server written with ``CheckpointMixin`` that keeps its own sessions (``seed_session``
  overridden, no ``checkpoint_mode``) makes every episode a restart: it says so at startup
  (naming the hooks to implement) and ``ng-checkpoint status`` notes it for that server.
- ``ng-checkpoint commit --all`` leaves out every episode any participant reported as a
  restart: the agent holds a session for a rollout the environment calls a restart, and
  a ``null`` scope would have it written.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from nemo_gym_checkpoint_plugin.testing.crash_scenario import run_body
from nemo_gym_checkpoint_plugin.testing.gym_config import (
    AGENT,
    DEFAULT_CHECKPOINT_BLOCK,
    ENVIRONMENT,
    RESOURCES,
    TOKEN_ENV,
    wrapped_entrypoints,
)
from nemo_gym_checkpoint_plugin.testing.harness import HARNESS_TOKEN

pytestmark = pytest.mark.slow

APP = Path(__file__).resolve().parent / "session_verifier_app.py"
NG_CHECKPOINT = [sys.executable, "-m", "nemo_gym_checkpoint_plugin.cli"]


async def cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("NG_CHECKPOINT_CONFIG",)}
    env.update({TOKEN_ENV: HARNESS_TOKEN, "COLUMNS": "80"})
    return await asyncio.to_thread(
        subprocess.run, [*NG_CHECKPOINT, *args], capture_output=True, text=True, timeout=120, env=env
    )


async def test_a_mixin_server_with_its_own_sessions_warns_at_startup_and_in_status(gym_deployment_factory, tmp_path):
    harness = gym_deployment_factory(entrypoints={**wrapped_entrypoints(), RESOURCES: str(APP)})
    log = harness.deployment.log_path(RESOURCES).read_text()
    assert "has its own seed_session and declares no checkpoint_mode, so every episode it seeds is a restart" in log
    assert "implement the participant hooks export and install" in log
    assert "checkpoint_mode: stateless" in log and "checkpoint_mode: export_restore" in log
    # The wheel's servers beside it are capturable: no warning there.
    for name in (ENVIRONMENT, AGENT):
        assert "every episode" not in harness.deployment.log_path(name).read_text()

    config = str(harness.deployment.write_config(tmp_path / "gym.yaml"))
    shown = await cli("status", "--config", config)
    assert shown.returncode == 0, shown.stderr
    # Each row's first line starts with its name (a long name wraps within its column).
    first_lines = {
        name: next(line for line in shown.stdout.splitlines() if line.startswith(name[:15]))
        for name in (RESOURCES, ENVIRONMENT, AGENT)
    }
    assert "every episode" in first_lines[RESOURCES]
    assert all("every episode" not in first_lines[name] for name in (ENVIRONMENT, AGENT))
    document = orjson.loads((await cli("status", "--config", config, "--json")).stdout)
    by_name = {p["name"]: p for p in document["participants"]}
    warning = by_name[RESOURCES]["restart_warning"]
    assert "SessionVerifier" in warning and "export and install" in warning
    assert not by_name[ENVIRONMENT].get("restart_warning") and not by_name[AGENT].get("restart_warning")


async def _run(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(url + "/run", json=body) as reply:
        assert reply.status == 200, await reply.text()
        return await reply.json()


async def test_commit_all_leaves_out_every_restart(gym_deployment_factory, tmp_path):
    # replay: prepare does not wait for the steps in flight, so both rollouts are held mid-turn at the checkpoint.
    harness = gym_deployment_factory(
        entrypoints=wrapped_entrypoints(), checkpoint={**DEFAULT_CHECKPOINT_BLOCK, "step_mode": "replay"}
    )
    config = str(harness.deployment.write_config(tmp_path / "gym.yaml"))
    ckpt = tmp_path / "ckpt"
    await harness.fake.hold(match="", count=2, step=1)
    limits = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=limits) as http:
        runs = [
            asyncio.ensure_future(_run(http, harness.env_url, run_body("cont-1"))),
            # task_data declares it a restart: the resources seed says so, and the environment lists it.
            asyncio.ensure_future(_run(http, harness.env_url, run_body("rst-1", restart=True))),
        ]
        await harness.fake.wait_for(lambda stats: stats["held"] >= 2, 60, "both rollouts' model calls held")
        prepared = await cli("prepare", "step-1", "--config", config, "--deadline", "30")
        assert prepared.returncode == 0, prepared.stdout + prepared.stderr
        assert "restarts (leave them out of the commit scope): rst-1" in prepared.stdout
        status = orjson.loads((await cli("status", "--config", config, "--json")).stdout)
        agent = next(p for p in status["participants"] if p["name"] == AGENT)
        assert agent["agent_sessions_open"] == 2  # the agent holds a session for the restart too

        committed = await cli("commit", "step-1", "--config", config, "--dir", str(ckpt), "--all", "--json")
        assert committed.returncode == 0, committed.stdout + committed.stderr
        document = orjson.loads(committed.stdout)
        written = {name: reply["episode_ids"] for name, reply in document["replies"].items()}
        assert all("rst-1" not in keys for keys in written.values()), written
        assert written[ENVIRONMENT] == ["cont-1"] and written[AGENT] == ["cont-1"]
        assert document["restarts_left_out"] == ["rst-1"]
        inspected = orjson.loads((await cli("inspect", str(ckpt), "--episodes", "--json")).stdout)
        assert all("rst-1" not in p["episodes"] for p in inspected["participants"])
        assert (await cli("resume", "step-1", "--config", config)).returncode == 0
        await harness.fake.release()
        replies = await asyncio.gather(*runs)
    assert all(reply.get("result") for reply in replies)


async def test_commit_all_in_words_names_the_restarts_it_left_out(gym_deployment_factory, tmp_path):
    harness = gym_deployment_factory(
        entrypoints=wrapped_entrypoints(), checkpoint={**DEFAULT_CHECKPOINT_BLOCK, "step_mode": "replay"}
    )
    config = str(harness.deployment.write_config(tmp_path / "gym.yaml"))
    await harness.fake.hold(match="", count=1, step=1)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        run = asyncio.ensure_future(_run(http, harness.env_url, run_body("rst-2", restart=True)))
        await harness.fake.wait_for(lambda stats: stats["held"] >= 1, 60, "the rollout's model call held")
        assert (await cli("prepare", "step-2", "--config", config, "--deadline", "30")).returncode == 0
        committed = await cli("commit", "step-2", "--config", config, "--dir", str(tmp_path / "c2"), "--all")
        assert committed.returncode == 0, committed.stderr
        assert "left out 1 restart(s) (they start over after a crash): rst-2" in committed.stdout
        assert (await cli("resume", "step-2", "--config", config)).returncode == 0
        await harness.fake.release()
        await run
