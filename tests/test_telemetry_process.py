"""Checkpoint metrics scraped from a real Gym deployment: checkpoint, SIGKILL every group, restore.

Real processes from the nemo-gym wheel (every server wrapped, checkpointing on) on 127.0.0.1; the
coordination library is the controller; every figure is read from a real scrape of
``GET /ng-control/v1/checkpoint/metrics`` with the control token (docs/telemetry.md).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nemo_gym_checkpoint_plugin.coordination import commit, discover, prepare, restore, resume
from nemo_gym_checkpoint_plugin.testing.crash_scenario import new_deployment
from nemo_gym_checkpoint_plugin.testing.gym_config import ENVIRONMENT, GYM_SERVERS, MODEL
from nemo_gym_checkpoint_plugin.testing.harness import GymHarness, send_rollout, wait_until_async

pytestmark = pytest.mark.slow

METRICS = "/ng-control/v1/checkpoint/metrics"
TOKEN = "telemetry-process-token"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def _scrape(url: str, token: str | None = TOKEN) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), trust_env=False) as http:
        async with http.get(url + METRICS, headers=headers) as reply:
            return reply.status, await reply.text()


async def _samples(url: str) -> Samples:
    status, text = await _scrape(url)
    assert status == 200, text
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def test_metrics_after_a_checkpoint_a_crash_and_a_restore(tmp_path: Path) -> None:
    # The demo's deployment (``make demo``): every server wrapped, a participant, in its own process group.
    deployment = new_deployment(tmp_path / "deployment", TOKEN)
    deployment.start()
    try:
        await _checkpoint_crash_restore(GymHarness(deployment), tmp_path)
    finally:
        deployment.stop()


async def _checkpoint_crash_restore(harness: GymHarness, tmp_path: Path) -> None:
    urls = {name: harness.urls[name] for name in GYM_SERVERS}
    for url in urls.values():
        assert (await _scrape(url, None))[0] == 401
        assert (await _scrape(url, "wrong-token"))[0] == 401
        assert _value(await _samples(url), "gym_checkpoint_completed_total") == 0

    # One rollout in flight: its second model call held at the fake backend.
    await harness.fake.hold(match="(rollout tel-0)", count=1, step=1)
    in_flight = asyncio.ensure_future(send_rollout(harness.env_url, "tel-0"))
    late: asyncio.Future[Any] | None = None
    checkpoint_dir = tmp_path / "ckpt"
    try:
        await harness.fake.wait_for(lambda s: s["held"] == 1, timeout=60, what="the held model call")
        coordinator = await discover(harness.deployment.config, TOKEN)
        async with coordinator:
            prepared = await prepare(coordinator, "tel-ckpt", timeout=60)
            assert prepared.ready, prepared.to_json()
            env = urls[ENVIRONMENT]
            during = await _samples(env)
            assert _value(during, "gym_checkpoint_in_progress", operation="checkpoint") == 1
            assert _value(during, "gym_checkpoint_admission_closed") == 1
            # A new rollout parks at the environment's closed gate; the scrape shows it parked.
            late = asyncio.ensure_future(send_rollout(env, "tel-late"))

            async def parked() -> bool:
                return _value(await _samples(env), "gym_checkpoint_parked_requests") == 1

            await wait_until_async(parked, timeout=30, what="the late rollout to park")
            scope = prepared.continued(["tel-0"])
            started = time.time()
            committed = await commit(coordinator, "tel-ckpt", str(checkpoint_dir), scope, timeout=60)
            await resume(coordinator, "tel-ckpt", timeout=60)

        for name, url in urls.items():
            samples = await _samples(url)
            assert _value(samples, "gym_checkpoint_completed_total") == 1, name
            assert started - 1 <= _value(samples, "gym_checkpoint_last_success_time_seconds") <= time.time(), name
            for phase in ("prepare", "commit", "resume"):
                assert _value(samples, "gym_checkpoint_duration_seconds_count", phase=phase) == 1, (name, phase)
            assert _value(samples, "gym_checkpoint_admission_closed_duration_seconds_count") == 1, name
            assert _value(samples, "gym_checkpoint_in_progress", operation="checkpoint") == 0, name
            manifest = committed.manifests[name]
            records = checkpoint_dir / "gym" / manifest["kind"] / manifest["instance"] / manifest["records_file"]
            assert _value(samples, "gym_checkpoint_size_bytes") == records.stat().st_size, name
            assert _value(samples, "gym_checkpoint_records") == manifest["record_count"], name
        env_samples = await _samples(urls[ENVIRONMENT])
        assert _value(env_samples, "gym_checkpoint_parked_requests") == 0
        assert _value(env_samples, "gym_checkpoint_parked_duration_seconds_count") >= 1
        assert _value(env_samples, "gym_checkpoint_episodes") == 1
    finally:
        await harness.fake.release()

    harness.crash()
    await asyncio.gather(in_flight, *([late] if late is not None else []), return_exceptions=True)
    await asyncio.to_thread(harness.restart)
    for url in urls.values():  # fresh processes: fresh registries
        assert _value(await _samples(url), "gym_checkpoint_completed_total") == 0

    coordinator = await discover(harness.deployment.config, TOKEN)
    async with coordinator:
        await restore(coordinator, "tel-restore", str(checkpoint_dir), scope, timeout=60)
        model = await _samples(urls[MODEL])
        assert _value(model, "gym_checkpoint_in_progress", operation="restore") == 1
        await resume(coordinator, "tel-restore", timeout=60)
    for name, url in urls.items():
        samples = await _samples(url)
        assert _value(samples, "gym_checkpoint_restored_total") == 1, name
        for stage in ("read", "install"):
            assert _value(samples, "gym_checkpoint_stage_duration_seconds_count", stage=stage) == 1, (name, stage)
        assert _value(samples, "gym_checkpoint_duration_seconds_count", phase="restore") == 1, name
        assert _value(samples, "gym_checkpoint_in_progress", operation="restore") == 0, name
        assert _value(samples, "gym_checkpoint_admission_closed_duration_seconds_count") == 1, name
