"""A checkpoint never waits for a generation: prepare time with N rollouts generating, against the generation time.

Starts the real deployment of the testing kit (every Gym server wrapped, checkpointing on,
the fake inference backend), makes every model call generate for ``--generation-seconds``
(default 10) at the backend, and sends ``--rollouts`` rollouts (default 1,000) to the
environment's ``/run``. Each rollout's first model call is held at the backend until all have
arrived, then all are released at once, so all N generate together. Then, in the same run:

- ``prepare_seconds``: the coordination library's prepare of every participant (environment,
  model, agent, resources), started right after the release, to ``prepared``;
- ``generating_at_prepared``: generations still running at the backend when it returned;
- ``generation_seconds``: from the release until the backend finished every one of them;
- ``held_at_model``: responses the model server held (not started) before resume.

Then the checkpoint is committed and resumed with the backend answering at once, and every
rollout must finish. ``--step-mode wait`` needs an agent that parks at its boundaries (the
environment otherwise waits for its agent step); ``replay`` never waits for one. The last line
is one JSON object.

    .venv/bin/python benchmarks/mid_turn.py [--rollouts 1000] [--step-mode replay|wait] [--generation-seconds 10]

Connection limits: each rollout holds one connection per hop at once (environment -> agent ->
model -> backend); Gym's data client allows 1,024 per host by default
(``global_aiohttp_connector_limit_per_host``), enough for 1,000. This script's own client has
no per-host limit.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from nemo_gym_checkpoint_plugin.coordination import commit, discover, prepare, resume
from nemo_gym_checkpoint_plugin.testing.deployment import BACKEND, ENVIRONMENT, MODEL, Deployment, free_port_base
from nemo_gym_checkpoint_plugin.testing.gym_config import DEFAULT_CHECKPOINT_BLOCK, TOKEN_ENV, wrapped_entrypoints
from nemo_gym_checkpoint_plugin.testing.harness import FakeBackend, rollout_body, wait_until_async

TOKEN = "mid-turn-bench-token"
_STATUS = "/ng-control/v1/checkpoint/status"


def say(message: str) -> None:
    print(f"[mid_turn] {message}", file=sys.stderr, flush=True)


def new_deployment(work_dir: Path, step_mode: str, rollouts: int) -> Deployment:
    deployment = Deployment(
        free_port_base(),
        work_dir,
        entrypoints=wrapped_entrypoints(),
        own_process_groups=True,
        log_dir=work_dir / "logs",
        extra_env={TOKEN_ENV: TOKEN},
        checkpoint={**DEFAULT_CHECKPOINT_BLOCK, "step_mode": step_mode},
    )
    return deployment


async def run_bench(deployment: Deployment, rollouts: int, generation_seconds: float, timeout: float) -> dict[str, Any]:
    urls = deployment.urls
    fake = FakeBackend(urls[BACKEND])
    ids = [f"bench-{i:05d}" for i in range(rollouts)]
    limits = aiohttp.ClientTimeout(total=None, connect=timeout, sock_read=timeout)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(timeout=limits, connector=connector, raise_for_status=True) as http:

        async def run(rollout_id: str) -> dict[str, Any]:
            async with http.post(urls[ENVIRONMENT] + "/run", json=rollout_body(rollout_id)) as reply:
                return await reply.json()

        async def model_held() -> int:
            async with http.get(urls[MODEL] + _STATUS, headers={"Authorization": f"Bearer {TOKEN}"}) as reply:
                return (await reply.json())["model_calls"]["held"]

        await fake.delay(generation_seconds)
        await fake.hold(match="", count=rollouts, step=0)
        runs = [asyncio.ensure_future(run(r)) for r in ids]
        sent = time.monotonic()
        await fake.wait_for(lambda s: s["held"] == rollouts, timeout, "every first model call at the backend")
        say(f"{rollouts} first model calls at the backend after {time.monotonic() - sent:.1f} s; releasing them")
        coordinator = await discover(deployment.config, TOKEN)
        async with coordinator:
            released_at = time.monotonic()
            await fake.release()
            started = time.monotonic()
            prepared = await prepare(coordinator, "mid-turn-bench", timeout=timeout)
            prepare_seconds = time.monotonic() - started
            generating = (await fake.stats())["generating"]
            if not prepared.ready:
                raise RuntimeError(f"prepare did not become ready: {prepared.to_json()}")
            say(f"prepared in {prepare_seconds:.3f} s with {generating} generations running")
            await fake.wait_for(lambda s: s["completed_total"] >= rollouts, timeout, "every generation finished")
            generation = time.monotonic() - released_at
            # Each generation still running when prepare returned ends with its response held at the model server.
            await wait_until_async(lambda: _equals(model_held, generating), timeout, "responses held at the model")
            held = await model_held()
            say(f"generations finished after {generation:.2f} s; {held} responses held at the model server")
            await fake.delay(0)
            started = time.monotonic()
            committed = await commit(
                coordinator,
                "mid-turn-bench",
                str(deployment.work_dir / "ckpt"),
                prepared.continued(ids),
                timeout=timeout,
            )
            commit_seconds = time.monotonic() - started
            await resume(coordinator, "mid-turn-bench", timeout=timeout)
        replies = await asyncio.gather(*runs)
    finished = [r for r in replies if r.get("failure") is None and r.get("result")]
    return {
        "benchmark": "mid_turn",
        "rollouts": rollouts,
        "prepare_seconds": round(prepare_seconds, 4),
        "generation_seconds": round(generation, 3),
        "generation_seconds_per_call": generation_seconds,
        "generating_at_prepared": generating,
        "held_at_model": held,
        "commit_seconds": round(commit_seconds, 3),
        "committed_episodes": len(committed.replies[ENVIRONMENT]["episode_ids"]),
        "finished": len(finished),
        "reward_1": sum(1 for r in finished if r["result"].get("reward") == 1.0),
        "prepared_under_1s_while_generating": prepare_seconds < 1.0 and generating == rollouts,
    }


async def _equals(read: Any, expected: int) -> bool:
    return await read() == expected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--step-mode", choices=("wait", "replay"), default="replay")
    parser.add_argument("--generation-seconds", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    work_dir = Path(tempfile.mkdtemp(prefix="ng-mid-turn-"))
    deployment = new_deployment(work_dir, args.step_mode, args.rollouts)
    try:
        say(f"starting the deployment in {work_dir}")
        deployment.start()
        figures = asyncio.run(run_bench(deployment, args.rollouts, args.generation_seconds, args.timeout))
    finally:
        deployment.stop()
    figures["step_mode"] = args.step_mode
    shutil.rmtree(work_dir, ignore_errors=True)
    print(orjson.dumps(figures).decode(), flush=True)
    return 0 if figures["prepared_under_1s_while_generating"] and figures["finished"] == args.rollouts else 1


if __name__ == "__main__":
    raise SystemExit(main())
