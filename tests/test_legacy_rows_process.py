"""Gym's flat-row environment (``single_agent_turn_legacy``) as a real process: continuing a restored rollout by hand.

A flat row naming only ``_ng_rollout_id: "3-0-a1"`` (no ``task_id``, no ``_ng_task_index``) made
Gym's ``materialize_task`` raise a ``ValueError``, answered as a 500. With checkpointing on it is a
typed 422 ``invalid_run_request`` that says what the row needs, nothing is left running, and the
row docs/trainer.md gives (the same row plus ``_ng_task_index``) runs as attempt 1 of ``3-0``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from nemo_gym_checkpoint_plugin.coordination import discover, retire
from nemo_gym_checkpoint_plugin.testing.deployment import rollout_body
from nemo_gym_checkpoint_plugin.testing.gym_config import DEFAULT_CHECKPOINT_BLOCK, ENVIRONMENT, wrapped_entrypoints
from nemo_gym_checkpoint_plugin.testing.harness import HARNESS_TOKEN

pytestmark = pytest.mark.slow

STATUS = "/ng-control/v1/checkpoint/status"


def _legacy_dir() -> Path:
    spec = importlib.util.find_spec("environment_servers.single_agent_turn_legacy.app")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent


def flat_row(rollout_id: str, **ids: Any) -> dict[str, Any]:
    """The collection's flat dataset row (its task fields) with the ``_ng_`` keys given."""
    return {**rollout_body(rollout_id.split("-a")[0])["task"]["task_input"], "_ng_rollout_id": rollout_id, **ids}


async def _post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        async with http.post(url, json=body, headers=headers) as reply:
            return reply.status, await reply.json(content_type=None)


async def _status(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        async with http.get(url + STATUS, headers={"Authorization": f"Bearer {HARNESS_TOKEN}"}) as reply:
            assert reply.status == 200
            return await reply.json()


async def test_a_row_without_task_identity_is_a_typed_422_and_the_documented_row_continues(
    gym_deployment_factory,
) -> None:
    harness = gym_deployment_factory(
        checkpoint=DEFAULT_CHECKPOINT_BLOCK, entrypoints=wrapped_entrypoints(), server_dirs={ENVIRONMENT: _legacy_dir()}
    )
    run = harness.env_url + "/run"

    status, reply = await _post(run, flat_row("3-0-a1"))
    assert status == 422, reply
    assert reply["error"]["code"] == "invalid_run_request", reply
    detail = reply["error"]["detail"]
    assert "requires a non-negative task_index" in detail and "'_ng_task_index'" in detail, detail
    # Refused before anything ran: no episode is booked, so the same attempt is not "running" elsewhere.
    assert (await _status(harness.env_url))["episodes"] == 0

    status, reply = await _post(run, flat_row("3-0-a1", _ng_task_index=3))
    assert status == 200, reply
    assert reply["reward"] == 1.0, reply
    # It ran as attempt 1 of 3-0: once that attempt is retired, the same row is a stale attempt.
    coordinator = await discover(harness.deployment.config, HARNESS_TOKEN)
    async with coordinator:
        await retire(coordinator, "retire-3-0", [{"rollout_id": "3-0", "attempt": 1}], timeout=30)
    status, reply = await _post(run, flat_row("3-0-a1", _ng_task_index=3))
    assert status == 409 and reply["error"]["code"] == "stale_attempt", reply
