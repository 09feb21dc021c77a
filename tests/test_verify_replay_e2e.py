"""``step_mode: replay`` on a real deployment: a rollout whose verify step is in flight when it crashes.

The resources server is ``example_single_tool_call`` whose ``/verify`` is held until the test
releases it (``tests/held_verify_server``). One rollout runs until it sits in its verify step;
a checkpoint is taken, every process group SIGKILLed, fresh processes restore it, and its next
attempt finishes. What ran is counted at the resources server (``/verify`` calls per attempt):

- declared replayable (``checkpoint_mode: stateless`` in its config): prepare does not wait for
  the verify step; the episode is written at its ``replied`` boundary and, after the crash, the
  verify runs again (once, as the replacement attempt);
- undeclared: the verify step is not replayable, so prepare waits for it (one blocker until the
  verify is released), the episode is written at ``verified`` and no verify runs after the crash.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from nemo_gym_checkpoint_plugin.coordination import commit, discover, prepare, restore, resume
from nemo_gym_checkpoint_plugin.testing.deployment import ENVIRONMENT, RESOURCES, Deployment, free_port_base
from nemo_gym_checkpoint_plugin.testing.gym_config import DEFAULT_CHECKPOINT_BLOCK, TOKEN_ENV, wrapped_entrypoints
from nemo_gym_checkpoint_plugin.testing.harness import send_rollout, wait_until_async

pytestmark = pytest.mark.slow

TOKEN = "verify-replay-token"
SERVER_DIR = Path(__file__).parent / "held_verify_server"
ROLLOUT = "in-verify"


async def _call(method: str, url: str, **kwargs: Any) -> Any:
    async with aiohttp.ClientSession() as http, http.request(method, url, **kwargs) as reply:
        reply.raise_for_status()
        return await reply.json()


async def _scenario(deployment: Deployment, checkpoint_dir: Path) -> dict[str, Any]:
    env, resources = deployment.urls[ENVIRONMENT], deployment.urls[RESOURCES]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    first = asyncio.ensure_future(send_rollout(env, ROLLOUT))

    async def in_verify() -> bool:
        return (await _call("GET", resources + "/health/test/verify_calls")).get(ROLLOUT) == 1

    await wait_until_async(in_verify, 60, "the rollout in its verify step")
    blocked = 0
    coordinator = await discover(deployment.config, TOKEN)
    async with coordinator:
        preparing = asyncio.ensure_future(prepare(coordinator, "ck-verify", timeout=60))

        async def settled() -> dict[str, Any] | None:
            status = await _call("GET", env + "/ng-control/v1/checkpoint/status", headers=auth)
            if status["phase"] == "prepared" or (status["phase"] == "preparing" and status["report"]["blocker_count"]):
                return status
            return None

        status = await wait_until_async(settled, 60, "the environment prepared or blocked")
        if status["phase"] == "preparing":
            blocked = status["report"]["blocker_count"]
            await _call("POST", resources + "/health/test/release")
        prepared = await preparing
        assert prepared.ready, prepared.to_json()
        committed = await commit(
            coordinator, "ck-verify", str(checkpoint_dir), prepared.continued([ROLLOUT]), timeout=60
        )
    deployment.kill()
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.to_thread(deployment.start)
    await _call("POST", resources + "/health/test/release")  # a replayed verify answers at once
    coordinator = await discover(deployment.config, TOKEN)
    async with coordinator:
        await restore(
            coordinator, "rs-verify", str(checkpoint_dir), [{"rollout_id": ROLLOUT, "attempt": 0}], timeout=60
        )
        await resume(coordinator, "rs-verify", timeout=60)
    reply = await send_rollout(env, ROLLOUT, attempt=1)
    return {
        "blocked": blocked,
        "boundaries": committed.replies[ENVIRONMENT]["boundaries"],
        "reply": reply,
        "verify_calls_after": await _call("GET", resources + "/health/test/verify_calls"),
    }


def _run(tmp_path: Path, block: dict[str, Any]) -> dict[str, Any]:
    work = tmp_path / "work"
    deployment = Deployment(
        free_port_base(),
        work,
        entrypoints=wrapped_entrypoints(),
        log_dir=work / "logs",
        extra_env={TOKEN_ENV: TOKEN},
        checkpoint={**DEFAULT_CHECKPOINT_BLOCK, "step_mode": "replay"},
        resources={"implementation": "held_verify", **block},
        server_dirs={RESOURCES: SERVER_DIR},
    )
    deployment.start()
    try:
        got = asyncio.run(_scenario(deployment, tmp_path / "ckpt"))
    finally:
        deployment.stop()
    reply = got["reply"]
    assert reply["failure"] is None, reply["failure"]
    assert reply["episode_id"] == {"rollout_id": ROLLOUT, "attempt": 1}
    assert reply["result"]["reward"] == 1.0
    return got


def test_a_declared_replayable_verify_in_flight_runs_again_after_the_crash(tmp_path: Path) -> None:
    got = _run(tmp_path, {"checkpoint_mode": "stateless"})
    assert got["blocked"] == 0  # prepare never waited for the verify step
    assert got["boundaries"] == {"replied": 1}
    assert got["verify_calls_after"] == {f"{ROLLOUT}-a1": 1}  # the verify ran again, as the next attempt


def test_an_undeclared_verify_in_flight_is_waited_for_at_prepare(tmp_path: Path) -> None:
    got = _run(tmp_path, {})
    assert got["blocked"] == 1  # prepare waited for the verify step until it was released
    assert got["boundaries"] == {"verified": 1}
    assert got["verify_calls_after"] == {}  # nothing ran the verify again
