"""On a real deployment: a crash in the middle of a multi-step stateful rollout, restore, continue.

The resources server is ``example_session_state_mgmt``'s counter (``tests/stateful_counter_server``:
the wheel's class, seeded from ``task_data`` the way ``single_agent_turn`` seeds), its
``session_id_to_counter`` named by ``checkpoint_session_state`` in its config: no plugin code.
Every server is wrapped (a participant), ``step_mode: wait``. The episode seeds the counter at
3, its agent step calls the ``increment_counter`` tool once (4) and answers; ``/verify`` gives
reward 1 only for ``expected_count: 4``.

The crashed rollout's last model call is held at the fake backend; prepare is ready at once (the
agent parks at its boundary after the tool call; a held model call never blocks), so the
rollout is checkpointed inside its agent turn (the environment at ``seeded``, the agent's record
holding the turn so far). Commit, SIGKILL every process group, fresh processes, restore, resume,
and the rollout's next attempt continues inside its turn. Counted at the servers: the resources
server ran no tool call again, the backend completed no model call again, and the reward
equals that of an uninterrupted rollout of the same task.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from nemo_gym_checkpoint_plugin.coordination import commit, discover, prepare, restore, resume
from nemo_gym_checkpoint_plugin.testing.deployment import (
    BACKEND,
    ENVIRONMENT,
    RESOURCES,
    Deployment,
    free_port_base,
    rollout_body,
)
from nemo_gym_checkpoint_plugin.testing.gym_config import DEFAULT_CHECKPOINT_BLOCK, TOKEN_ENV, wrapped_entrypoints
from nemo_gym_checkpoint_plugin.testing.harness import FakeBackend

pytestmark = pytest.mark.slow

TOKEN = "session-state-e2e-token"
SERVER_DIR = Path(__file__).parent / "stateful_counter_server"
TASK_DATA = {"initial_count": 3, "expected_count": 4}
INCREMENT_TOOL = {
    "type": "function",
    "name": "increment_counter",
    "description": "",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"count": {"type": "integer", "description": ""}},
        "required": ["count"],
        "additionalProperties": False,
    },
}


def counter_body(rollout_id: str, attempt: int = 0) -> dict[str, Any]:
    body = rollout_body(rollout_id, attempt=attempt, prompt=f"count up once (rollout {rollout_id})")
    task_input = body["task"]["task_input"]
    task_input["responses_create_params"]["tools"] = [INCREMENT_TOOL]
    task_input["task_data"] = dict(TASK_DATA)
    return body


def counter_deployment(work_dir: Path, step_mode: str = "wait") -> Deployment:
    return Deployment(
        free_port_base(),
        work_dir,
        entrypoints=wrapped_entrypoints(),
        log_dir=work_dir / "logs",
        extra_env={TOKEN_ENV: TOKEN},
        checkpoint={**DEFAULT_CHECKPOINT_BLOCK, "step_mode": step_mode},
        resources={"implementation": "stateful_counter", "checkpoint_session_state": ["session_id_to_counter"]},
        server_dirs={RESOURCES: SERVER_DIR},
    )


async def _get(url: str, **kwargs: Any) -> Any:
    async with aiohttp.ClientSession() as http, http.get(url, **kwargs) as reply:
        reply.raise_for_status()
        return await reply.json()


async def _run(env: str, body: dict[str, Any]) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http, http.post(env + "/run", json=body) as reply:
        reply.raise_for_status()
        return await reply.json()


async def _scenario(deployment: Deployment, checkpoint_dir: Path) -> dict[str, Any]:
    urls = deployment.urls
    env, resources = urls[ENVIRONMENT], urls[RESOURCES]
    fake = FakeBackend(urls[BACKEND])
    auth = {"Authorization": f"Bearer {TOKEN}"}

    reference = await _run(env, counter_body("ctr-reference"))  # uninterrupted, same task

    crashed = "ctr-crashed"
    conversation = counter_body(crashed)["task"]["task_input"]["responses_create_params"]["input"][1]["content"]
    await fake.hold(match=crashed, count=1, step=1)  # the answer after the tool call
    first = asyncio.ensure_future(_run(env, counter_body(crashed)))
    await fake.wait_for(lambda s: s["held"] >= 1, 60, "the crashed rollout's last model call held")
    # Its tool call ran before the held answer; read now (once a checkpoint closes admission, data routes park).
    tool_calls_before = await _get(resources + "/_test/tool_calls")

    coordinator = await discover(deployment.config, TOKEN)
    async with coordinator:
        # Mid-turn: the agent parks at its boundary after the tool call; the held model call never blocks.
        prepared = await prepare(coordinator, "ck-state", timeout=60)
        assert prepared.ready, prepared.to_json()
        committed = await commit(
            coordinator, "ck-state", str(checkpoint_dir), prepared.continued([crashed]), timeout=60
        )
    completed_before = (await fake.stats())["completed"][conversation]

    deployment.kill()
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.to_thread(deployment.start)

    coordinator = await discover(deployment.config, TOKEN)
    async with coordinator:
        restored = await restore(
            coordinator, "rs-state", str(checkpoint_dir), [{"rollout_id": crashed, "attempt": 0}], timeout=60
        )
        await resume(coordinator, "rs-state", timeout=60)
    continued = await _run(env, counter_body(crashed, attempt=1))
    return {
        "reference": reference,
        "continued": continued,
        "committed": committed,
        "restored": restored,
        "tool_calls_before": tool_calls_before,
        "tool_calls_after": await _get(resources + "/_test/tool_calls"),
        "completed_before": completed_before,
        "stats_after": await fake.stats(),
        "conversation": conversation,
        "resources_status": await _get(resources + "/ng-control/v1/checkpoint/status", headers=auth),
    }


def test_a_crash_mid_rollout_continues_the_counter_with_no_step_run_twice(tmp_path: Path) -> None:
    deployment = counter_deployment(tmp_path / "work")
    deployment.start()
    try:
        got = asyncio.run(_scenario(deployment, tmp_path / "ckpt"))
    finally:
        deployment.stop()

    # Checkpointed inside the agent turn: the tool call had run, the answer after it had not.
    assert got["committed"].replies[ENVIRONMENT]["boundaries"] == {"seeded": 1}
    assert got["committed"].replies[RESOURCES]["episode_ids"] == ["ctr-crashed"]
    assert got["tool_calls_before"] == {"ctr-reference": 1, "ctr-crashed": 1}
    assert got["completed_before"] == {"0": 1}
    assert got["restored"].replies[RESOURCES]["restored"] == ["ctr-crashed-a1"]
    assert got["resources_status"]["checkpoint_mode"] == "export_restore"

    continued, reference = got["continued"], got["reference"]
    assert continued["failure"] is None, continued["failure"]
    assert continued["episode_id"] == {"rollout_id": "ctr-crashed", "attempt": 1}
    # The same reward as the uninterrupted run: the counter came back at 4 (a lost one reads 0, a repeated call 5).
    assert reference["result"]["reward"] == 1.0
    assert continued["result"]["reward"] == reference["result"]["reward"]
    # No tool call ran again (the fresh resources server ran none) and no completed model call was sent
    # again: the fresh backend saw only the answer that had not completed before the crash.
    assert got["tool_calls_after"] == {}
    assert got["stats_after"]["calls"][got["conversation"]] == {"1": 1}
