"""Parked data calls holding every data connection cannot starve prepare, commit or resume."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from coord_support import FOUR, TOKEN, start_participants, stop_participants
from nemo_gym import server_utils

from nemo_gym_checkpoint_plugin.coordination import commit, discover, prepare, resume

pytestmark = pytest.mark.slow

DATA_LIMIT = 4


async def wait_for_parked(server, count: int, timeout: float = 10.0) -> None:
    async def parked() -> None:
        while sum(1 for e in server.events() if e["op"] == "run" and e["event"] == "arrive") < count:
            await asyncio.sleep(0.02)  # wait-ok: polling the participant's log (bounded by wait_for)

    await asyncio.wait_for(parked(), timeout)


async def test_full_data_pool_does_not_block_control_calls(tmp_path, monkeypatch):
    specs = [dict(spec, holds=["r1"]) for spec in FOUR]
    servers = start_participants(tmp_path, specs)
    model = servers[1]
    # Gym's own data path: its global aiohttp client (what rollout collection and servers use), small.
    monkeypatch.setattr(server_utils, "_GLOBAL_AIOHTTP_CLIENT", None)
    data = server_utils.set_global_aiohttp_client(
        server_utils.GlobalAIOHTTPAsyncClientConfig(
            global_aiohttp_connector_limit=DATA_LIMIT, global_aiohttp_connector_limit_per_host=DATA_LIMIT
        )
    )
    parked = []
    try:
        parked = [
            asyncio.create_task(server_utils.request("POST", f"{model.url}/run", json={"rollout_id": f"r{i}"}))
            for i in range(DATA_LIMIT)
        ]
        await wait_for_parked(model, DATA_LIMIT)
        # The data pool is full: one more data call cannot even get a connection.
        extra = asyncio.create_task(server_utils.request("GET", f"{model.url}/"))
        done, _ = await asyncio.wait({extra}, timeout=0.5)
        assert not done, "the data pool was not full"

        async with await discover([s.url for s in servers], TOKEN) as coordinator:
            result = await asyncio.wait_for(prepare(coordinator, "step-1", timeout=5), 10)
            assert result.ready
            committed = await asyncio.wait_for(
                commit(coordinator, "step-1", str(tmp_path / "c"), ["r1"], timeout=5), 10
            )
            assert committed.episode_ids[model.name] == ["r1"]
            await asyncio.wait_for(resume(coordinator, "step-1", timeout=5), 10)
        assert not extra.done() and not any(task.done() for task in parked)

        # Released (through a connection of its own: the data pool is still full), every data call completes.
        async with aiohttp.ClientSession() as session, session.post(f"{model.url}/test/release") as response:
            assert response.status == 200
        replies = await asyncio.wait_for(asyncio.gather(*parked, extra), 10)
        assert all(reply.status == 200 for reply in replies)
        for reply in replies:
            reply.release()
    finally:
        for task in parked:
            task.cancel()
        await data.close()
        stop_participants(servers)
