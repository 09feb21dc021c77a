"""End to end with two replica chains: checkpoint rollouts held in both, SIGKILL everything, restore, finish.

``Deployment(replicas=2)`` runs ``single_agent_turn -> simple_agent -> policy_model`` and
``single_agent_turn_2 -> simple_agent_2 -> policy_model_2`` beside one resources server
and one fake backend, each a real process. The coordinator finds all seven servers from
the config alone; one commit and one restore span both chains, and each replica writes
and restores only the episodes that ran through it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from nemo_gym_checkpoint_plugin.api import capture_key
from nemo_gym_checkpoint_plugin.coordination import commit, discover, prepare, restore, resume
from nemo_gym_checkpoint_plugin.testing.crash_scenario import run_body
from nemo_gym_checkpoint_plugin.testing.deployment import (
    AGENT,
    BACKEND,
    ENVIRONMENT,
    MODEL,
    RESOURCES,
    Deployment,
    free_port_base,
    gym_servers,
    port_span,
    replica_name,
    rollout_body,
)
from nemo_gym_checkpoint_plugin.testing.gym_config import DEFAULT_CHECKPOINT_BLOCK, TOKEN_ENV, wrapped_entrypoints
from nemo_gym_checkpoint_plugin.testing.harness import wait_until_async

pytestmark = pytest.mark.slow

TOKEN = "e2e-replicas-token"
TIMEOUT = 90.0
# Rollouts sent to each replica's environment server, by replica number.
ROLLOUTS = {1: [f"one-{i}" for i in range(3)], 2: [f"two-{i}" for i in range(3)]}
ALL = [r for ids in ROLLOUTS.values() for r in ids]


def _keys(rollouts: list[str], attempt: int) -> list[str]:
    """Gym's capture keys (``EpisodeId.capture_key``): the rollout id for attempt 0, ``<id>-a<n>`` after."""
    return sorted(capture_key(r, attempt) for r in rollouts)


def _conversation(rollout_id: str) -> str:
    return rollout_body(rollout_id)["task"]["task_input"]["responses_create_params"]["input"][1]["content"]


def test_two_replica_chains_checkpoint_sigkill_restore_and_finish_every_rollout(tmp_path: Path) -> None:
    deployment = Deployment(
        free_port_base(port_span(2)),
        tmp_path,
        entrypoints=wrapped_entrypoints(),
        own_process_groups=True,
        log_dir=tmp_path / "logs",
        extra_env={TOKEN_ENV: TOKEN},
        checkpoint={**DEFAULT_CHECKPOINT_BLOCK, "step_mode": "wait"},
        replicas=2,
    )
    deployment.start()
    try:
        asyncio.run(_scenario(deployment, tmp_path / "ckpt"))
    finally:
        deployment.stop()


async def _scenario(deployment: Deployment, checkpoint_dir: Path) -> None:
    names = gym_servers(2)
    assert set(deployment.urls) == {BACKEND, *names}
    assert len(set(deployment.urls.values())) == len(names) + 1
    envs = dict(enumerate(deployment.replica_urls(ENVIRONMENT), start=1))
    backend = deployment.urls[BACKEND]
    limits = aiohttp.ClientTimeout(total=None, connect=TIMEOUT, sock_read=TIMEOUT)
    async with aiohttp.ClientSession(timeout=limits) as http:

        async def stats() -> dict[str, Any]:
            async with http.get(backend + "/_fake/stats") as reply:
                return await reply.json()

        async def run(replica: int, rollout_id: str, attempt: int) -> dict[str, Any]:
            async with http.post(envs[replica] + "/run", json=run_body(rollout_id, attempt)) as reply:
                assert reply.status == 200, await reply.text()
                return await reply.json()

        async def held(count: int) -> bool:
            return (await stats())["held"] >= count

        async with http.post(backend + "/_fake/hold", json={"match": "", "count": len(ALL), "step": 1}):
            pass
        first = [asyncio.ensure_future(run(i, r, 0)) for i, ids in ROLLOUTS.items() for r in ids]
        await wait_until_async(lambda: held(len(ALL)), TIMEOUT, "every rollout's second model call held")

        coordinator = await discover(deployment.config, TOKEN)
        async with coordinator:
            # Every replica is a participant, found from the config alone.
            assert sorted(p.name for p in coordinator.participants) == sorted(names)
            prepared = await prepare(coordinator, "replicas", timeout=TIMEOUT)
            assert prepared.ready, prepared.to_json()
            for i in ROLLOUTS:
                # Each model replica holds the calls of its own chain's agent only.
                assert prepared.reports[replica_name(MODEL, i)]["counts"]["model_calls_in_flight"] == 3, i
            scope = prepared.continued(ALL)
            committed = await commit(coordinator, "replicas", str(checkpoint_dir), scope, timeout=TIMEOUT)
        # Each chain wrote exactly the episodes that ran through it (the models export nothing without
        # token capture; their prepare counts above show the chain reaches model_i).
        for i, ids in ROLLOUTS.items():
            for name in (ENVIRONMENT, AGENT):
                reply = committed.replies[replica_name(name, i)]
                assert reply["episode_ids"] == _keys(ids, 0), (name, i)
                # Under its own instance directory, beside the other replica's.
                assert reply["manifest"]["instance"] == replica_name(name, i)
        assert committed.replies[RESOURCES]["episode_ids"] == _keys(ALL, 0)
        completed_before = (await stats())["completed"]

        deployment.kill()
        await asyncio.gather(*first, return_exceptions=True)
        await asyncio.to_thread(deployment.start)

        coordinator = await discover(deployment.config, TOKEN)
        async with coordinator:
            restored = await restore(coordinator, "replicas-restore", str(checkpoint_dir), scope, timeout=TIMEOUT)
            await resume(coordinator, "replicas-restore", timeout=TIMEOUT)
        for i, ids in ROLLOUTS.items():
            assert restored.replies[replica_name(ENVIRONMENT, i)]["restored"] == _keys(ids, 1), i

        # Each rollout goes back to the replica that restored it and finishes inside its turn.
        second = await asyncio.gather(*(run(i, r, 1) for i, ids in ROLLOUTS.items() for r in ids))
        after = await stats()
    for rollout_id, reply in zip(ALL, second, strict=True):
        assert reply["episode_id"] == {"rollout_id": rollout_id, "attempt": 1}
        assert reply["result"]["reward"] == 1.0, rollout_id
        conversation = _conversation(rollout_id)
        # Only the call held at the crash ran again: the first model call and the tool call were restored.
        assert completed_before[conversation] == {"0": 1}
        assert after["calls"][conversation] == {"1": 1}
