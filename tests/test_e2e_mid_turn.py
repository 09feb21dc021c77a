"""End to end on a real Gym deployment: rollouts checkpointed inside their agent turn, SIGKILL, restore, finish.

Every server of the wheel wrapped (checkpointing on, ``step_mode: wait``), the fake backend
scripting a multi-call turn (``[tool_rounds=3]``: the tool is called three times before the
answer) and holding one model call of each rollout mid-turn, the coordination library as
the controller. Asserted from what the servers counted: the backend's completed calls per
(conversation, step) and the resources server's tool calls per rollout.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from nemo_gym_checkpoint_plugin.testing.crash_scenario import new_deployment
from nemo_gym_checkpoint_plugin.testing.deployment import AGENT, BACKEND, ENVIRONMENT, RESOURCES, rollout_body

pytestmark = pytest.mark.slow

TOKEN = "e2e-mid-turn-token"
ROUNDS = 3
# Rollout -> the model step held when prepare starts (the call after that many tool calls).
HELD_AT = {"turn-0": 1, "turn-1": 2, "turn-2": 3, "turn-3": 1}
_STATUS = "/ng-control/v1/checkpoint/status"
_BOUND = 90.0


def _body(rollout: str, attempt: int) -> dict[str, Any]:
    return rollout_body(rollout, attempt=attempt, prompt=f"weather please ({rollout}) [tool_rounds={ROUNDS}]")


def _conversation(rollout: str) -> str:
    return _body(rollout, 0)["task"]["task_input"]["responses_create_params"]["input"][1]["content"]


def _what_the_trainer_reads(reply: dict[str, Any]) -> list[Any]:
    """The rollout's output as the trainer reads it: items without their per-call random ids."""
    return [{k: v for k, v in item.items() if k != "id"} for item in reply["result"]["response"]["output"]]


async def _poll(predicate: Any, what: str) -> Any:
    async with asyncio.timeout(_BOUND):
        while not (value := await predicate()):
            await asyncio.sleep(0.05)  # wait-ok: poll interval of a bounded wait on a condition
    assert value, what
    return value


async def _scenario(tmp_path: Path, model: dict[str, Any] | None) -> dict[str, Any]:
    from nemo_gym_checkpoint_plugin.coordination import commit, discover, prepare, restore, resume

    deployment = new_deployment(tmp_path, TOKEN, step_mode="wait", model=model)
    deployment.start()
    urls = deployment.urls
    auth = {"Authorization": f"Bearer {TOKEN}"}
    limits = aiohttp.ClientTimeout(total=None, connect=_BOUND, sock_read=_BOUND)
    try:
        async with aiohttp.ClientSession(timeout=limits, raise_for_status=True) as http:

            async def call(method: str, url: str, **kwargs: Any) -> Any:
                async with http.request(method, url, **kwargs) as reply:
                    return await reply.json()

            async def stats() -> dict[str, Any]:
                return await call("GET", urls[BACKEND] + "/_fake/stats")

            async def tool_calls() -> dict[str, int]:
                return (await call("GET", urls[RESOURCES] + _STATUS, headers=auth))["tool_calls_by_rollout"]

            async def run(rollout: str, attempt: int) -> dict[str, Any]:
                return await call("POST", urls[ENVIRONMENT] + "/run", json=_body(rollout, attempt))

            for rollout, step in HELD_AT.items():
                await call("POST", urls[BACKEND] + "/_fake/hold", json={"match": f"({rollout})", "step": step})
            first = {r: asyncio.ensure_future(run(r, 0)) for r in HELD_AT}
            await _poll(lambda: _held(stats, len(HELD_AT)), "every rollout's model call held mid-turn")

            coordinator = await discover(deployment.config, TOKEN)
            async with coordinator:
                started = time.monotonic()
                prepared = await prepare(coordinator, "mid-turn", timeout=30)
                prepare_seconds = time.monotonic() - started
                # wait mode, and ready while every held call is still generating at the backend.
                held_when_prepared = (await stats())["held"]
                print(f"prepare reached prepared in {prepare_seconds:.3f} s with {held_when_prepared} calls held")
                scope = prepared.continued(list(HELD_AT))
                ckpt = tmp_path / "ckpt"
                committed = await commit(coordinator, "mid-turn", str(ckpt), scope, timeout=30)
                completed_before = (await stats())["completed"]
                tools_before = await tool_calls()

            deployment.kill()
            await asyncio.gather(*first.values(), return_exceptions=True)
            await asyncio.to_thread(deployment.start)

            coordinator = await discover(deployment.config, TOKEN)
            async with coordinator:
                restored = await restore(coordinator, "mid-turn-restore", str(ckpt), scope, timeout=30)
                await resume(coordinator, "mid-turn-restore", timeout=30)
            continued = dict(zip(HELD_AT, await asyncio.gather(*(run(r, 1) for r in HELD_AT)), strict=True))
            completed_after = (await stats())["completed"]
            tools_after = await tool_calls()
            # The same rollouts, uninterrupted, as a fresh attempt on the same servers.
            uninterrupted = dict(zip(HELD_AT, await asyncio.gather(*(run(r, 2) for r in HELD_AT)), strict=True))
    finally:
        deployment.stop()
    agent_records = _records(tmp_path / "ckpt" / "gym" / "agent" / AGENT)
    return {
        "prepared": prepared,
        "held_when_prepared": held_when_prepared,
        "committed": committed,
        "restored": restored,
        "continued": continued,
        "uninterrupted": uninterrupted,
        "completed_before": completed_before,
        "completed_after": completed_after,
        "tools_before": tools_before,
        "tools_after": tools_after,
        "agent_records": agent_records,
    }


def _records(directory: Path) -> dict[str, dict[str, Any]]:
    manifest = json.loads((directory / "manifest.json").read_text())
    lines = (directory / manifest["records_file"]).read_text().splitlines()
    return {json.loads(line)["episode_id"]["rollout_id"]: json.loads(line) for line in lines}


async def _held(stats: Any, count: int) -> bool:
    return (await stats())["held"] >= count


def _assert_continued_inside_the_turn(result: dict[str, Any]) -> None:
    prepared = result["prepared"]
    assert prepared.ready and prepared.restarts() == []
    assert result["held_when_prepared"] == len(HELD_AT)
    # The environment exported each rollout inside its agent step; the agent, the turn so far.
    assert result["committed"].replies[ENVIRONMENT]["boundaries"] == {"seeded": len(HELD_AT)}
    for rollout, step in HELD_AT.items():
        calls = result["agent_records"][rollout]["turn"]["calls"]
        assert [c["call"] for c in calls] == ["model", "tool"] * step, rollout
    assert result["restored"].replies[ENVIRONMENT]["restored"] == sorted(f"{r}-a1" for r in HELD_AT)
    for rollout in HELD_AT:
        conversation = _conversation(rollout)
        before = result["completed_before"].get(conversation, {})
        after = result["completed_after"].get(conversation, {})
        # No completed (conversation, step) call was sent twice: each step completed once, before or after.
        total = {s: before.get(s, 0) + after.get(s, 0) for s in {*before, *after}}
        assert total == {str(s): 1 for s in range(ROUNDS + 1)}, (rollout, before, after)
        assert sorted(before) == [str(s) for s in range(HELD_AT[rollout])], (rollout, before)
        # No tool call ran twice.
        assert result["tools_before"].get(rollout, 0) + result["tools_after"].get(rollout, 0) == ROUNDS, rollout
        reply, reference = result["continued"][rollout], result["uninterrupted"][rollout]
        assert reply["failure"] is None, reply["failure"]
        assert reply["episode_id"] == {"rollout_id": rollout, "attempt": 1}
        assert reply["result"]["reward"] == reference["result"]["reward"] == 1.0
        assert _what_the_trainer_reads(reply) == _what_the_trainer_reads(reference)


def test_a_checkpoint_inside_agent_turns_never_waits_for_generation_and_resumes_inside_the_turn(
    tmp_path: Path,
) -> None:
    _assert_continued_inside_the_turn(asyncio.run(_scenario(tmp_path, None)))


def test_with_token_ids_the_continued_turn_carries_every_calls_token_ids_once(tmp_path: Path) -> None:
    result = asyncio.run(_scenario(tmp_path, {"return_token_id_information": True}))
    _assert_continued_inside_the_turn(result)
    for rollout in HELD_AT:
        output = result["continued"][rollout]["result"]["response"]["output"]
        generated = [tuple(item["generation_token_ids"]) for item in output if "generation_token_ids" in item]
        # One generation per model call of the turn (its tool calls and the answer), none repeated or missing.
        assert len(generated) == ROUNDS + 1 and len(set(generated)) == ROUNDS + 1, (rollout, generated)
