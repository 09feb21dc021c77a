"""docs/trainer.md's worked example runs as written, on real Gym servers, across a SIGKILL (issue 24).

The example is extracted from the page (so the page cannot rot) and drives the deployment with Gym's own
``RolloutCollectionHelper`` (its ``_episode_request_body`` builds every ``/run``) and Gym's own
``ServerClient``, unpatched, through the public controller client: rows in flight are checkpointed, every
server is SIGKILLed, fresh servers are restored, each restored rollout is resent as its replacement attempt
N+1 (the explicit ``"<id>-a1"`` Gym sends as attempt 0, decoded by the environment), the restart is retired
and resent, and every rollout is forgotten once it finished. Counted at the servers: nothing lost, no
completed step repeated, no ``/run`` resent after the dropped connection.
"""

from __future__ import annotations

import ast
import asyncio
import re
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nemo_gym import server_utils
from nemo_gym.server_utils import BaseServerConfig, GlobalAIOHTTPAsyncClientConfig, ServerClient

from nemo_gym_checkpoint_plugin.testing.crash_scenario import RESTART_TASK_DATA
from nemo_gym_checkpoint_plugin.testing.deployment import BACKEND, ENVIRONMENT, RESOURCES, rollout_body
from nemo_gym_checkpoint_plugin.testing.gym_config import DEFAULT_CHECKPOINT_BLOCK, wrapped_entrypoints
from nemo_gym_checkpoint_plugin.testing.harness import HARNESS_TOKEN

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parent.parent / "docs" / "trainer.md"
STATUS = "/ng-control/v1/checkpoint/status"
CONTINUED = ["t0", "t1", "t2"]
RESTART = "t3"


def example_module() -> types.ModuleType:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert blocks, "docs/trainer.md must hold the worked python example (its first python block)"
    for block in blocks[1:]:  # the smaller snippets after it must at least be valid Python
        compile(block, str(DOC), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    module = types.ModuleType("trainer_example")
    exec(compile(blocks[0], str(DOC), "exec"), module.__dict__)  # noqa: S102 - our own doc
    return module


def row(rollout_id: str) -> dict[str, Any]:
    """A materialized row as a trainer holds it, named by an explicit rollout id (as NeMo RL names them)."""
    task = rollout_body(rollout_id)["task"]
    if rollout_id == RESTART:
        task["task_input"]["task_data"] = dict(RESTART_TASK_DATA)
    return {"task_id": task["task_id"], "task_input": task["task_input"], "_ng_rollout_id": rollout_id}


def conversation(rollout_id: str) -> str:
    return rollout_body(rollout_id)["task"]["task_input"]["responses_create_params"]["input"][1]["content"]


@pytest.fixture
async def gym_http() -> AsyncIterator[None]:
    """Gym's process-wide aiohttp session (what Gym's setup makes in a trainer), on this test's loop."""
    session = server_utils.set_global_aiohttp_client(GlobalAIOHTTPAsyncClientConfig())
    try:
        yield
    finally:
        await session.close()
        server_utils._GLOBAL_AIOHTTP_CLIENT = None


async def test_the_documented_trainer_loop_restores_and_finishes_every_rollout(
    gym_deployment_factory, gym_http, tmp_path: Path
) -> None:
    harness = gym_deployment_factory(checkpoint=DEFAULT_CHECKPOINT_BLOCK, entrypoints=wrapped_entrypoints())
    urls = harness.urls
    config = harness.deployment.config
    # Gym's own client, unpatched, as a trainer builds it from the deployment's config.
    gym_client = ServerClient(head_server_config=BaseServerConfig(**config["head_server"]), global_config_dict=config)
    trainer = example_module().CheckpointedRollouts(gym_client, HARNESS_TOKEN, ENVIRONMENT, tmp_path / "ckpt")
    rollouts = [*CONTINUED, RESTART]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:

        async def get(url: str) -> Any:
            async with http.get(url, headers={"Authorization": f"Bearer {HARNESS_TOKEN}"}) as reply:
                reply.raise_for_status()
                return await reply.json()

        # Each rollout's last model call (step 1, after the tool call) is held: every row is in flight.
        await harness.fake.hold(match="", count=len(rollouts), step=1)
        batch = asyncio.ensure_future(trainer.run([row(r) for r in rollouts]))
        await harness.fake.wait_for(lambda s: s["held"] >= len(rollouts), 60, "every rollout's model call held")

        scope = await trainer.take_checkpoint(step=1)
        assert sorted(e["rollout_id"] for e in scope) == CONTINUED  # the restart is left out
        assert all(e["attempt"] == 0 for e in scope)
        seeds_before = (await get(urls[RESOURCES] + STATUS))["seed_sessions_by_rollout"]
        completed_before = (await harness.fake.stats())["completed"]
        assert all(seeds_before.get(r) == 1 for r in rollouts)

        harness.crash()
        # The cut /run calls come back as dropped connections, at once: none is sent again (Gym's own
        # client would keep resending them, and this wait would run out).
        await asyncio.wait_for(batch, 60)
        assert trainer.dropped == set(rollouts) and trainer.results == {}
        await asyncio.to_thread(harness.restart)

        await asyncio.wait_for(trainer.recover(), 120)

        assert sorted(trainer.results) == sorted(rollouts)
        for rollout_id, reply in trainer.results.items():
            assert reply.get("failure") is None and (reply.get("result") or {}).get("reward") == 1.0, reply
            # The explicit "<id>-a1" Gym sent as attempt 0 ran as attempt 1 of the rollout.
            assert reply["episode_id"] == {"rollout_id": rollout_id, "attempt": 1}
        seeds_after = (await get(urls[RESOURCES] + STATUS))["seed_sessions_by_rollout"]
        # Restored rollouts continue from their boundary: no seed again; the restart starts over.
        assert {r: seeds_after.get(r, 0) for r in rollouts} == {**dict.fromkeys(CONTINUED, 0), RESTART: 1}
        completed_after = (await harness.fake.stats())["completed"]
        for rollout_id in CONTINUED:
            before, after = completed_before[conversation(rollout_id)], completed_after[conversation(rollout_id)]
            assert not set(before) & set(after), f"{rollout_id} repeated a completed model call: {before} {after}"
        # Forgotten everywhere once finished: no retired mark is left on any participant.
        for name, url in urls.items():
            if name != BACKEND:
                assert (await get(url + STATUS))["retired_rollouts"] == 0, name


def test_the_example_uses_only_public_names() -> None:
    source = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[0]
    assert re.findall(r"nemo_gym_checkpoint_plugin\.[a-z_.]*\._\w+|ckpt\._\w+", source) == []
