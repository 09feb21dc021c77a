"""Mid-turn on a real deployment, no crash: a checkpoint taken while model responses are held at the model server.

Every server is wrapped (a participant), ``step_mode: replay`` (so the environment does not
wait for the agent step the held calls belong to). Each rollout's first model call is held
at the fake backend when prepare starts; the backend then answers, and the model server
holds each response until resume. After commit and resume every rollout must finish with
the output an uninterrupted run gives, and no call may have reached the backend twice.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from nemo_gym_checkpoint_plugin.coordination import commit, discover, prepare, resume
from nemo_gym_checkpoint_plugin.testing.crash_scenario import new_deployment
from nemo_gym_checkpoint_plugin.testing.deployment import BACKEND, ENVIRONMENT, MODEL, rollout_body
from nemo_gym_checkpoint_plugin.testing.harness import FakeBackend, wait_until_async

pytestmark = pytest.mark.slow

TOKEN = "model-mid-turn-token"
COUNT = 4
STATUS = "/ng-control/v1/checkpoint/status"


def prompt(i: int) -> str:
    return f"what's it like in sf? (mid-turn conversation {i})"


def comparable(value: Any) -> Any:
    """A ``/run`` result without what differs between two identical runs (generated ids, timestamps)."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if k not in ("id", "created_at", "episode_id")}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    return value


async def test_prepare_commit_resume_with_responses_held_at_the_model_server(tmp_path: Path) -> None:
    deployment = new_deployment(tmp_path, TOKEN, step_mode="replay")
    deployment.start()
    try:
        await _scenario(deployment, tmp_path / "ckpt")
    finally:
        deployment.stop()


async def _scenario(deployment: Any, checkpoint_dir: Path) -> None:
    urls = deployment.urls
    fake = FakeBackend(urls[BACKEND])
    timeout = aiohttp.ClientTimeout(total=None, connect=60, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout, raise_for_status=True) as http:

        async def run(rollout_id: str, i: int) -> dict[str, Any]:
            async with http.post(urls[ENVIRONMENT] + "/run", json=rollout_body(rollout_id, prompt=prompt(i))) as r:
                return await r.json()

        async def model_status() -> dict[str, Any]:
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with http.get(urls[MODEL] + STATUS, headers=headers) as reply:
                return await reply.json()

        # The uninterrupted run, then the same conversations again from clean counters.
        reference = await asyncio.gather(*(run(f"ref-{i}", i) for i in range(COUNT)))
        await fake.reset()

        await fake.hold(match="mid-turn conversation", count=COUNT, step=0)
        rollouts = [f"mid-{i}" for i in range(COUNT)]
        runs = [asyncio.ensure_future(run(r, i)) for i, r in enumerate(rollouts)]
        await fake.wait_for(lambda s: s["held"] == COUNT, 60, "every first model call at the backend")
        coordinator = await discover(deployment.config, TOKEN)
        async with coordinator:
            started = time.monotonic()
            prepared = await prepare(coordinator, "mid-turn-1", timeout=60)
            prepare_seconds = time.monotonic() - started
            assert prepared.ready, prepared.to_json()
            # Prepared while every generation still runs at the backend: readiness never waited for one.
            assert (await fake.stats())["held"] == COUNT, prepare_seconds
            await fake.release()
            await wait_until_async(
                lambda: _held_at_model(model_status, COUNT), 60, "every response held at the model server"
            )
            assert not any(task.done() for task in runs)
            committed = await commit(coordinator, "mid-turn-1", str(checkpoint_dir), prepared.continued(rollouts))
            assert sorted(committed.replies[ENVIRONMENT]["episode_ids"]) == rollouts
            assert committed.replies[MODEL]["episode_ids"] == []  # held calls belong to no checkpoint
            await resume(coordinator, "mid-turn-1")
        replies = await asyncio.gather(*runs)

    for i, reply in enumerate(replies):
        assert reply["failure"] is None, reply
        assert reply["result"]["reward"] == 1.0
        assert comparable(reply["result"]) == comparable(reference[i]["result"])
    stats = await fake.stats()
    assert stats["repeated"] == []
    for i in range(COUNT):
        assert stats["calls"][prompt(i)] == {"0": 1, "1": 1}
    assert (await model_status_once(urls[MODEL]))["model_calls"]["held_total"] == COUNT


async def _held_at_model(model_status: Any, count: int) -> bool:
    return (await model_status())["model_calls"]["held"] == count


async def model_status_once(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession(raise_for_status=True) as http:
        async with http.get(url + STATUS, headers={"Authorization": f"Bearer {TOKEN}"}) as reply:
            return await reply.json()
