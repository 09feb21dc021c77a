"""Gym's training-token ledger across a real crash: the rows Gym's rebuild reads hold every call exactly once.

A real Gym deployment (every server wrapped, ``step_mode: wait``) with 0.7.0's
``token_id_capture`` block on (``all_agents``, its file store under the test's directory, so
the restarted processes write to the same ledger) and ``return_token_id_information`` on the
policy model. One rollout runs a multi-call turn (``[tool_rounds=3]``: three tool calls, then
the answer); its model call after the second tool call is still generating at the backend
(held there) when the checkpoint is prepared and committed. Every process is SIGKILLed, the deployment restarted,
the checkpoint restored and resumed, and the rollout sent again as attempt 1. Gym's own
rebuild (``trajectories_for_rollout``) of attempt 1's ledger is then accepted, unmasked, with
each of the turn's four model calls once: the two answered before the crash come from the
checkpoint (the model participant installs them under the attempt), the rest from the
continued turn.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nemo_gym.token_id_capture import TokenCaptureStore, trajectories_for_rollout

from nemo_gym_checkpoint_plugin.testing.deployment import (
    BACKEND,
    DEFAULT_CHECKPOINT_BLOCK,
    ENVIRONMENT,
    TOKEN_ENV,
    Deployment,
    free_port_base,
    rollout_body,
)
from nemo_gym_checkpoint_plugin.testing.gym_config import wrapped_entrypoints

pytestmark = pytest.mark.slow

TOKEN = "e2e-token-capture-token"
ROLLOUT = "ledger-0"
ROUNDS = 3
HELD_STEP = 2  # the model call after two tool calls is generating when the checkpoint is taken
_BOUND = 90.0


def _body(attempt: int) -> dict[str, Any]:
    return rollout_body(ROLLOUT, attempt=attempt, prompt=f"weather please ({ROLLOUT}) [tool_rounds={ROUNDS}]")


async def _poll(predicate: Any, what: str) -> Any:
    async with asyncio.timeout(_BOUND):
        while not (value := await predicate()):
            await asyncio.sleep(0.05)  # wait-ok: poll interval of a bounded wait on a condition
    assert value, what
    return value


async def _crash_and_continue(tmp_path: Path, captures: Path) -> dict[str, Any]:
    from nemo_gym_checkpoint_plugin.coordination import commit, discover, prepare, restore, resume

    deployment = Deployment(
        free_port_base(),
        tmp_path,
        entrypoints=wrapped_entrypoints(),
        own_process_groups=True,
        log_dir=tmp_path / "logs",
        extra_env={TOKEN_ENV: TOKEN},
        checkpoint={**DEFAULT_CHECKPOINT_BLOCK, "step_mode": "wait"},
        model={"return_token_id_information": True},
        # Run-wide, so every server (and the restarted ones) writes the one ledger the trainer reads.
        gym_settings={"token_id_capture": {"enabled": True, "all_agents": True, "dir": str(captures)}},
    )
    deployment.start()
    urls = deployment.urls
    limits = aiohttp.ClientTimeout(total=None, connect=_BOUND, sock_read=_BOUND)
    try:
        async with aiohttp.ClientSession(timeout=limits, raise_for_status=True) as http:

            async def call(method: str, url: str, **kwargs: Any) -> Any:
                async with http.request(method, url, **kwargs) as reply:
                    return await reply.json()

            async def held() -> bool:
                return (await call("GET", urls[BACKEND] + "/_fake/stats"))["held"] >= 1

            async def run(attempt: int) -> dict[str, Any]:
                return await call("POST", urls[ENVIRONMENT] + "/run", json=_body(attempt))

            await call("POST", urls[BACKEND] + "/_fake/hold", json={"match": f"({ROLLOUT})", "step": HELD_STEP})
            first = asyncio.ensure_future(run(0))
            await _poll(held, "the rollout's model call held mid-turn")

            coordinator = await discover(deployment.config, TOKEN)
            async with coordinator:
                prepared = await prepare(coordinator, "ledger", timeout=30)
                scope = prepared.continued([ROLLOUT])
                ckpt = tmp_path / "ckpt"
                await commit(coordinator, "ledger", str(ckpt), scope, timeout=30)
            before_crash = [e.model_call_id for e in TokenCaptureStore(captures).read_entries(ROLLOUT)]

            deployment.kill()
            await asyncio.gather(first, return_exceptions=True)
            await asyncio.to_thread(deployment.start)

            coordinator = await discover(deployment.config, TOKEN)
            async with coordinator:
                await restore(coordinator, "ledger-restore", str(ckpt), scope, timeout=30)
                await resume(coordinator, "ledger-restore", timeout=30)
            continued = await run(1)
    finally:
        deployment.stop()
    return {"prepared": prepared, "before_crash": before_crash, "continued": continued}


def test_after_a_crash_the_ledger_gym_rebuilds_holds_every_call_of_the_turn_once(tmp_path: Path) -> None:
    captures = tmp_path / "captures"
    result = asyncio.run(_crash_and_continue(tmp_path, captures))
    assert result["prepared"].ready and result["prepared"].restarts() == []
    # The dead attempt 0 recorded the answered calls; the held one was still generating at the backend.
    assert len(result["before_crash"]) == HELD_STEP, result["before_crash"]
    reply = result["continued"]
    assert reply["failure"] is None, reply["failure"]
    assert reply["episode_id"] == {"rollout_id": ROLLOUT, "attempt": 1}
    assert reply["result"]["reward"] == 1.0

    attempt = f"{ROLLOUT}-a1"
    built = trajectories_for_rollout(attempt, [captures])
    assert built is not None, "Gym's rebuild found no ledger for the continued attempt"
    assert built["mask_sample"] is False, built
    assert built["metrics"]["n_calls"] == ROUNDS + 1 and not built["metrics"].get("capture_incomplete"), built
    ids = [e.model_call_id for e in TokenCaptureStore(captures).read_entries(attempt)]
    # Every model call of the turn once: the answered ones from before the crash, then the continued ones.
    assert len(ids) == len(set(ids)) == ROUNDS + 1, ids
    assert ids[:HELD_STEP] == result["before_crash"]
