"""Servers with several uvicorn workers in a real deployment: the wheel's servers, real uvicorn, 127.0.0.1, SIGKILL.

The environment server runs ``num_workers: 4`` through the wrapper (Gym's run_webserver, uvicorn's
supervisor spawning the workers, the coordinator in the main process); every control call goes to
its one port and reaches whichever worker uvicorn hands it to, which forwards it. A worker is
SIGKILLed by the pid the server's ``status`` names; uvicorn replaces it, as after a real crash.
These tests start their own processes (not the test zygote: a zygote forks Gym servers, and a
forked uvicorn supervisor spawning workers of its own is not what a real deployment runs).

The ``make demo`` story with 4 workers on the model, resources and environment servers is
``test_the_demo_story_with_four_workers`` (the demo's ``--num-workers``); the same with Gym's token
capture on, checking the capture invariant with Gym's own rebuild, is
``test_the_demo_story_with_four_workers_and_token_capture`` (``--token-capture``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from nemo_gym_checkpoint_plugin.testing.crash_scenario import WORKER_HEALTHCHECK_SECONDS, start_timeout
from nemo_gym_checkpoint_plugin.testing.gym_config import (
    DEFAULT_CHECKPOINT_BLOCK,
    ENVIRONMENT,
    wrapped_entrypoints,
)
from nemo_gym_checkpoint_plugin.testing.harness import HARNESS_TOKEN, GymHarness, new_deployment, wait_until_async

pytestmark = pytest.mark.slow

WORKERS = 4
CONTROL = "/ng-control/v1/checkpoint"
AUTH = {"Authorization": f"Bearer {HARNESS_TOKEN}"}


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GymHarness]:
    deployment = new_deployment(
        tmp_path_factory.mktemp("workers-uvicorn"),
        entrypoints=wrapped_entrypoints(),
        checkpoint={**DEFAULT_CHECKPOINT_BLOCK, "step_mode": "wait"},
        environment={"num_workers": WORKERS},
        gym_settings={"uvicorn_timeout_worker_healthcheck": WORKER_HEALTHCHECK_SECONDS},
    )
    deployment.start(timeout=start_timeout(WORKERS))
    try:
        yield GymHarness(deployment)
    finally:
        deployment.stop()


async def control(url: str, route: str, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as http:
        if route == "status":
            return await http.get(f"{CONTROL}/status", headers=AUTH)
        return await http.post(f"{CONTROL}/{route}", json={"deadline_ts": time.time() + 20, **body}, headers=AUTH)


async def workers_when(url: str, predicate: Any, what: str) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        workers = (await control(url, "status")).json()["workers"]
        return workers if predicate(workers) else None

    return await wait_until_async(check, start_timeout(WORKERS), what)


def pid_of(worker: str) -> int:
    return int(worker.removeprefix("worker "))


async def kill_worker(url: str, worker: str) -> None:
    os.kill(pid_of(worker), signal.SIGKILL)
    await workers_when(url, lambda w: worker in w["left"], f"{worker} to leave")


async def test_sigkill_mid_prepare_then_a_new_checkpoint_then_lost_after_readiness_then_restore(
    harness: GymHarness, tmp_path: Path
) -> None:
    env = harness.urls[ENVIRONMENT]
    workers = await workers_when(env, lambda w: len(w["connected"]) == WORKERS, f"{WORKERS} workers")
    assert workers["expected"] == WORKERS and workers["left"] == []

    # A worker SIGKILLed while idle: until uvicorn's replacement registered (it imports Gym first, seconds),
    # a prepare is blocked by the missing worker; another SIGKILLed now, mid-prepare, blocks it for good.
    first = workers["connected"][0]
    await kill_worker(env, first)
    reply = (await control(env, "prepare", checkpoint_id="c1", deadline_ts=time.time() + 0.5)).json()
    assert reply["phase"] == "preparing", reply
    assert reply["report"]["worker_blockers"] == [f"worker not registered ({WORKERS - 1} of {WORKERS}), #1"]
    victim = workers["connected"][1]
    await kill_worker(env, victim)
    await workers_when(env, lambda w: len(w["connected"]) == WORKERS, "both replacements")
    reply = (await control(env, "prepare", checkpoint_id="c1", deadline_ts=time.time() + 1)).json()
    assert reply["phase"] == "preparing", reply
    assert reply["report"]["worker_blockers"] == [f"{victim} disconnected during c1"]
    assert (await control(env, "resume", checkpoint_id="c1")).json()["phase"] == "idle"

    # uvicorn replaced the worker: a new checkpoint is prepared and committed with all four.
    await workers_when(env, lambda w: len(w["connected"]) == WORKERS, "the replacement worker")
    reply = (await control(env, "prepare", checkpoint_id="c2")).json()
    assert reply["phase"] == "prepared", reply
    assert reply["report"]["counts"]["workers"] == WORKERS
    committed = await control(env, "commit", checkpoint_id="c2", checkpoint_dir=str(tmp_path / "ck2"), episode_ids=None)
    assert committed.status_code == 200 and committed.json()["phase"] == "committed", committed.text
    assert (await control(env, "resume", checkpoint_id="c2")).json()["phase"] == "idle"

    # A worker lost between readiness and export: the commit fails export_failed, final for the id.
    reply = (await control(env, "prepare", checkpoint_id="c3")).json()
    assert reply["phase"] == "prepared", reply
    lost = (await control(env, "status")).json()["workers"]["connected"][-1]
    await kill_worker(env, lost)
    for _ in range(2):
        failed = await control(
            env, "commit", checkpoint_id="c3", checkpoint_dir=str(tmp_path / "ck3"), episode_ids=None
        )
        assert failed.status_code == 409, failed.text
        assert failed.json()["error"]["code"] == "export_failed" and lost in failed.json()["error"]["detail"]
    assert not list((tmp_path / "ck3").rglob("manifest.json"))
    assert (await control(env, "resume", checkpoint_id="c3")).json()["phase"] == "idle"

    # Workers left this server: a restore is refused before it marks anything, replacements or not.
    await workers_when(env, lambda w: len(w["connected"]) == WORKERS, "the second replacement")
    refused = await control(
        env,
        "restore",
        checkpoint_id="r1",
        checkpoint_dir=str(tmp_path / "ck2"),
        episode_ids=[{"rollout_id": "x", "attempt": 1}],
    )
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == "invalid_phase" and "left" in refused.json()["error"]["detail"]
    status = (await control(env, "status")).json()
    assert status["phase"] == "idle" and status["retired_rollouts"] == 0
    assert set(status["workers"]["left"]) == {first, victim, lost}


PARKED = "gym_checkpoint_parked_requests"
PARKS = "gym_checkpoint_parked_duration_seconds_count"
REFUSED = "gym_checkpoint_refused_requests_total"


async def scrape(url: str) -> dict[str, float]:
    """The server's metrics (served by its coordinator, whichever worker the scrape reached) by series."""
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as http:
        reply = await http.get(f"{CONTROL}/metrics", headers=AUTH)
    assert reply.status_code == 200, reply.text
    return {
        series: float(value)
        for series, _, value in (line.rpartition(" ") for line in reply.text.splitlines())
        if series and not series.startswith("#")
    }


async def test_the_metrics_count_the_workers_parked_and_refused_requests(harness: GymHarness) -> None:
    env = harness.urls[ENVIRONMENT]
    await workers_when(env, lambda w: len(w["connected"]) == WORKERS, f"{WORKERS} workers")
    before = await scrape(env)
    assert before[PARKED] == 0
    async with httpx.AsyncClient(base_url=env, trust_env=False, timeout=60) as http:
        # Admission closed on every worker: a data request parks in whichever worker accepted it.
        assert (await control(env, "prepare", checkpoint_id="m1")).json()["phase"] == "prepared"
        parked = asyncio.ensure_future(http.get("/ng-rollout/metrics-parked/nothing-here"))

        async def parked_now() -> dict[str, float] | None:
            figures = await scrape(env)
            return figures if figures[PARKED] == 1 else None

        during = await wait_until_async(parked_now, 30, "the parked request in the metrics")
        assert during[PARKS] == before[PARKS]  # a park is counted when it ends
        assert (await control(env, "resume", checkpoint_id="m1")).json()["phase"] == "idle"
        assert (await asyncio.wait_for(parked, 30)).status_code == 404  # it went on to the app
        # A retired attempt's request is refused stale_attempt by whichever worker accepted it.
        episode = {"rollout_id": "metrics-refused", "attempt": 0}
        assert (await control(env, "retire", checkpoint_id="m2", episode_ids=[episode])).status_code == 200
        refused = await http.get("/ng-rollout/metrics-refused/nothing-here")
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "stale_attempt", refused.text
        await control(env, "forget", checkpoint_id="m2", rollout_ids=["metrics-refused"])
    after = await scrape(env)
    assert after[PARKED] == 0
    assert after[PARKS] == before[PARKS] + 1
    assert after[REFUSED] == before[REFUSED] + 1
    assert after['gym_checkpoint_parked_duration_seconds_bucket{le="+Inf"}'] == after[PARKS]


def _demo(work: Path, *args: str) -> dict[str, Any]:
    """Run the demo in ``work`` with 4 workers; its summary, once it exited 0 with the demo's guarantees."""
    demo = [sys.executable, "-m", "nemo_gym_checkpoint_plugin.testing.demo"]
    done = subprocess.run(
        [*demo, "--num-workers", "4", "--dir", str(work), *args],
        capture_output=True,
        timeout=1800,
        env={**os.environ, "PORT_BASE": ""},
    )
    assert done.returncode == 0, done.stdout.decode()[-3000:] + done.stderr.decode()[-3000:]
    summary: dict[str, Any] = orjson.loads(done.stdout.splitlines()[-1])
    assert summary["lost"] == 0 and summary["repeated_steps"] == 0 and summary["identical_to_uninterrupted"]
    assert summary["continued"] >= 1 and summary["finished"] == summary["rollouts"]
    return summary


def test_the_demo_story_with_four_workers(tmp_path: Path) -> None:
    """``make demo NUM_WORKERS=4``: nothing lost, nothing repeated, identical to the uninterrupted run."""
    _demo(tmp_path)


def test_the_demo_story_with_four_workers_and_token_capture(tmp_path: Path) -> None:
    """``make demo NUM_WORKERS=4 TOKEN_CAPTURE=1``: the same guarantees, and the capture invariant.

    32 rows (the story's held rows and crash are the same; half the rows keep the run near the other's
    time). Besides the demo's own check, every output row's finished attempt is rebuilt here with Gym's
    ``trajectories_for_rollout`` from the capture directory: unmasked, complete, and with one call per
    model call of the demo's turn (a tool call, then the answer). The continued rows finished as their
    replacement attempt, whose rows the model workers' claims installed.
    """
    from nemo_gym.token_id_capture import trajectories_for_rollout

    from nemo_gym_checkpoint_plugin.testing.crash_scenario import capture_dir

    summary = _demo(tmp_path, "--token-capture", "--rollouts", "32")
    assert summary["capture"] == {"rows": 32, "masked": [], "n_calls_wrong": {}}, summary["capture"]
    rows = [orjson.loads(line) for line in (tmp_path / "collected" / "rollouts.jsonl").read_bytes().splitlines()]
    assert sorted(row["_ng_task_index"] for row in rows) == list(range(32))
    continued = 0
    for row in rows:
        attempt = row.get("_ng_attempt_index") or 0
        continued += attempt == 1
        key = f"{row['_ng_task_index']}-0" + (f"-a{attempt}" if attempt else "")
        built = trajectories_for_rollout(key, [capture_dir(tmp_path)])
        assert built is not None and built["mask_sample"] is False, (key, built)
        assert built["metrics"]["n_calls"] == 2 and not built["metrics"].get("capture_incomplete"), (key, built)
    assert continued == summary["continued"]
