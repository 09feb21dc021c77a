"""The policy model participant on a real deployment: Gym's ``vllm_model`` (wrapped) in front of the fake backend.

Model calls are sent to the model server as the plugin's client sends them, under
``/ng-rollout/<capture key>/``; the fake backend holds them and counts what reached it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym_checkpoint_plugin.testing.gym_config import MODEL, WRAP_ENTRYPOINT
from nemo_gym_checkpoint_plugin.testing.harness import HARNESS_TOKEN, GymHarness, new_deployment, wait_until_async

pytestmark = pytest.mark.slow

CONTROL = "/ng-control/v1/checkpoint"
AUTH = {"Authorization": f"Bearer {HARNESS_TOKEN}"}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": ""}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GymHarness]:
    deployment = new_deployment(tmp_path_factory.mktemp("model-participant"), entrypoints={MODEL: WRAP_ENTRYPOINT})
    deployment.start()
    try:
        yield GymHarness(deployment)
    finally:
        deployment.stop()


def model_call(conversation: str) -> dict[str, Any]:
    return {"input": [{"role": "user", "content": conversation}], "tools": [WEATHER_TOOL]}


def comparable(value: Any) -> Any:
    """A response without what differs between two identical generations (ids, timestamps)."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if k not in ("id", "created_at", "call_id")}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    return value


async def control(url: str, route: str, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as http:
        if route == "status":
            return await http.get(f"{CONTROL}/status", headers=AUTH)
        return await http.post(f"{CONTROL}/{route}", json={"deadline_ts": time.time() + 20, **body}, headers=AUTH)


async def status_when(url: str, predicate: Any, what: str) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        body = (await control(url, "status")).json()
        return body if predicate(body) else None

    return await wait_until_async(check, 20, what)


async def test_prepare_does_not_wait_for_a_generation_and_resume_delivers_the_held_response(
    harness: GymHarness, tmp_path: Path
) -> None:
    model = harness.urls[MODEL]
    async with httpx.AsyncClient(base_url=model, trust_env=False, timeout=60) as http:
        reference = (await http.post("/ng-rollout/ref-1/v1/responses", json=model_call("conv held-ref"))).json()
        await harness.fake.hold(match="conv held-1")
        call = asyncio.create_task(http.post("/ng-rollout/held-1/v1/responses", json=model_call("conv held-1")))
        await harness.fake.wait_for(lambda s: s["held"] == 1, 20, "the call generating at the backend")

        started = time.monotonic()
        prepared = await control(model, "prepare", checkpoint_id="mid-1")
        assert time.monotonic() - started < 1.0
        assert prepared.json()["phase"] == "prepared", prepared.text
        assert prepared.json()["report"]["counts"]["model_calls_in_flight"] == 1

        # A new call parks at closed admission: it never reaches the backend while the checkpoint is open.
        parked = asyncio.create_task(http.post("/ng-rollout/new-1/v1/responses", json=model_call("conv new-1")))
        await harness.fake.release("conv held-1")  # the generation finishes: its response is held
        status = await status_when(model, lambda b: b["model_calls"]["held"] == 1, "the response held")
        assert status["kind"] == "model" and status["phase"] == "prepared"
        assert not call.done() and not parked.done()
        committed = await control(
            model, "commit", checkpoint_id="mid-1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=None
        )
        assert committed.status_code == 200, committed.text
        assert committed.json()["episode_ids"] == []  # a held call belongs to no checkpoint
        assert "conv new-1" not in (await harness.fake.stats())["calls"]

        resumed = await control(model, "resume", checkpoint_id="mid-1")
        assert resumed.json()["phase"] == "idle"
        delivered, fresh = await asyncio.gather(call, parked)
    assert delivered.status_code == fresh.status_code == 200
    assert comparable(delivered.json()) == comparable(reference)
    stats = await harness.fake.stats()
    assert stats["calls"]["conv held-1"] == {"0": 1} and stats["calls"]["conv new-1"] == {"0": 1}


async def test_retire_drops_the_generation_at_the_worker_and_refuses_late_calls(harness: GymHarness) -> None:
    model = harness.urls[MODEL]
    before = (await harness.fake.stats())["abandoned_total"]
    async with httpx.AsyncClient(base_url=model, trust_env=False, timeout=60) as http:
        await harness.fake.hold(match="conv retired-1")
        call = asyncio.create_task(http.post("/ng-rollout/ret-1-a2/v1/responses", json=model_call("conv retired-1")))
        await harness.fake.wait_for(lambda s: s["held"] == 1, 20, "the call generating at the backend")
        episode = {"rollout_id": "ret-1", "attempt": 2}
        retired = await control(model, "retire", checkpoint_id="op-r", episode_ids=[episode])
        assert retired.status_code == 200 and retired.json()["retired_count"] == 1, retired.text
        # The retire replied only after the call ended: its caller already has its refusal.
        assert call.done()
        reply = call.result()
        assert reply.status_code == 409 and reply.json()["error"]["code"] == "stale_attempt"
        stats = await harness.fake.wait_for(
            lambda s: s["abandoned_total"] == before + 1, 10, "the backend to see the request dropped"
        )
        assert stats["held"] == 0 and "conv retired-1" not in stats["completed"]
        late = await http.post("/ng-rollout/ret-1-a1/v1/responses", json=model_call("conv retired-1"))
        assert late.status_code == 409 and late.json()["error"]["code"] == "stale_attempt"
    assert (await harness.fake.stats())["calls"]["conv retired-1"] == {"0": 1}
    status = (await control(model, "status")).json()
    assert status["kind"] == "model" and status["model_calls"]["stopped_total"] == 1
