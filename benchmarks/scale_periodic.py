"""``scale.py --checkpoint-every S --duration D``: checkpoints at a fixed interval while N rollouts progress.

The deployment of ``scale.py`` (the same servers, replica chains and Gym settings), but nothing is
held: every model call waits ``--generation-seconds`` at the fake backend before its answer (its
simulated generation; by default N / 50 s, so the machine keeps up with N rollouts in flight), and
each of N slots runs rollouts back to back (rollout ``p<slot>-<k>``), the slots started
``--ramp-rate`` a second. Once every slot has started, a checkpoint every S seconds for D seconds:
prepare (admission closed), commit of every rollout not yet returned, resume (admission open). The
rollouts progress between checkpoints (a call answered, a tool called) and stand still within one.

Per checkpoint: its pause (prepare's start to resume's end: admission closed), prepare, commit and
resume seconds, the rollouts in flight, exported, the bytes it added under the checkpoint root
(each checkpoint its own directory there: with incremental commits, what a later one writes is what
changed), and each server's CPU seconds in its commit. Per run: ``pause_s_max`` (the longest pause
after the first checkpoint), ``pause_share`` (paused time over the checkpointing window's wall
time), ``bytes_full`` (the first checkpoint's bytes) and ``bytes_incremental`` (the mean bytes of
the later ones; equal to the full size until commits are incremental), beside ``scale.py``'s keys
(``prepare_s``, ``commit_s``, ``bytes_written``, ``cpu_s``: the first checkpoint's), rollouts
finished and failed. Nothing is killed or restored: ``scale.py`` without these flags measures that.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from nemo_gym_checkpoint_plugin.coordination import commit, discover, prepare, resume
from nemo_gym_checkpoint_plugin.testing.crash_scenario import run_body
from nemo_gym_checkpoint_plugin.testing.deployment import BACKEND, ENVIRONMENT, Deployment, free_port_base, port_span
from nemo_gym_checkpoint_plugin.testing.gym_config import DEFAULT_CHECKPOINT_BLOCK, TOKEN_ENV, wrapped_entrypoints

sys.path.insert(0, str(Path(__file__).parent))
from process_stats import bytes_under, cpu_used  # noqa: E402  (a sibling script, not a package)

# Rollouts a second the machine finishes with everything on 2 cores is about 30-40 (docs/performance.md):
# a generation of N / 50 s per call (two calls a rollout) keeps N in flight at about 25 a second.
ROLLOUTS_PER_SECOND = 50
DEFAULT_RAMP_RATE = 30.0


def default_generation_seconds(rollouts: int) -> float:
    return max(5.0, rollouts / ROLLOUTS_PER_SECOND)


def summarize(checkpoints: list[dict[str, Any]], window_s: float) -> dict[str, Any]:
    """The run's figures from its checkpoints: the longest later pause, paused share of the window, bytes."""
    later = checkpoints[1:]
    paused = sum(c["pause_s"] for c in checkpoints)
    return {
        "checkpoints_taken": len(checkpoints),
        "pause_s_first": checkpoints[0]["pause_s"] if checkpoints else None,
        "pause_s_max": max((c["pause_s"] for c in later), default=None),
        "pause_s_mean": round(sum(c["pause_s"] for c in later) / len(later), 4) if later else None,
        "pause_share": round(paused / window_s, 5) if window_s > 0 else None,
        "bytes_full": checkpoints[0]["bytes"] if checkpoints else None,
        "bytes_incremental": round(sum(c["bytes"] for c in later) / len(later)) if later else None,
    }


async def run_periodic(
    rollouts: int,
    replicas: int,
    step_mode: str,
    timeout: float,
    every: float,
    duration: float,
    *,
    generation_seconds: float | None = None,
    ramp_rate: float = DEFAULT_RAMP_RATE,
    keep: bool = False,
    gym_settings: dict[str, Any],
    environment: dict[str, Any],
    live: list[Deployment],
    say: Any = print,
) -> dict[str, Any]:
    generation = default_generation_seconds(rollouts) if generation_seconds is None else generation_seconds
    work = Path(tempfile.mkdtemp(prefix=f"ng-periodic-{rollouts}-"))
    token = secrets.token_urlsafe(24)
    deployment = Deployment(
        free_port_base(port_span(replicas)),
        work,
        entrypoints=wrapped_entrypoints(),
        own_process_groups=True,
        log_dir=work / "logs",
        extra_env={TOKEN_ENV: token},
        checkpoint={**DEFAULT_CHECKPOINT_BLOCK, "step_mode": step_mode},
        gym_settings=gym_settings,
        replicas=replicas,
        environment=environment,
    )
    live.append(deployment)
    root = work / "checkpoints"
    root.mkdir()
    result: dict[str, Any] = {
        "rollouts": rollouts,
        "step_mode": step_mode,
        "replicas": replicas,
        "checkpoint_every_s": every,
        "duration_s": duration,
        "generation_seconds": generation,
        "ramp_rate": ramp_rate,
    }
    in_flight: dict[str, None] = {}  # rollouts whose /run has not returned, in start order
    done = {"finished": 0, "failed": 0}
    stop = asyncio.Event()
    await asyncio.to_thread(deployment.start, 300.0)
    try:
        envs, backend = deployment.replica_urls(ENVIRONMENT), deployment.urls[BACKEND]
        limits = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=timeout, sock_read=None)
        connector = aiohttp.TCPConnector(limit=rollouts, limit_per_host=math.ceil(rollouts / replicas))
        async with (
            aiohttp.ClientSession(timeout=limits, connector=connector) as http,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as control,
        ):
            async with control.post(backend + "/_fake/delay", json={"seconds": generation}):
                pass

            async def slot(index: int) -> None:
                await asyncio.sleep(index / ramp_rate)  # wait-ok: the ramp's pacing, not a condition
                serial = 0
                while not stop.is_set():
                    rollout = f"p{index}-{serial}"
                    serial += 1
                    in_flight[rollout] = None
                    try:
                        async with http.post(envs[index % replicas] + "/run", json=run_body(rollout, 0)) as reply:
                            body = await reply.json(content_type=None)
                        good = reply.status == 200 and (body.get("result") or {}).get("reward") == 1.0
                    except (aiohttp.ClientError, ValueError):
                        good = False
                    finally:
                        in_flight.pop(rollout, None)
                    done["finished" if good else "failed"] += 1

            # Discovered before the load starts: a status probe under it can take longer than discovery's 2 s.
            coordinator = await discover(deployment.config, token, probe_timeout=timeout)
            started = time.monotonic()
            slots = [asyncio.ensure_future(slot(i)) for i in range(rollouts)]
            try:
                await asyncio.sleep(rollouts / ramp_rate)  # wait-ok: every slot has started by then
                result["ramp_s"] = round(time.monotonic() - started, 3)
                result["in_flight_after_ramp"] = len(in_flight)
                say(f"[{rollouts}] ramp done in {result['ramp_s']}s: {len(in_flight)} rollouts in flight")
                async with coordinator:
                    checkpoints = await _checkpoints(
                        deployment, coordinator, root, in_flight, every, duration, timeout, say
                    )
                result["window_s"] = round(time.monotonic() - started - result["ramp_s"], 3)
            finally:
                stop.set()
                for task in slots:
                    task.cancel()
                await asyncio.gather(*slots, return_exceptions=True)
    finally:
        deployment.kill()
        live.remove(deployment)
    result.update(done)
    result["checkpoints"] = checkpoints
    result.update(summarize(checkpoints, result["window_s"]))
    first = checkpoints[0] if checkpoints else {}
    # scale.py's keys, the first (full) checkpoint's.
    for key, theirs in (("prepare_s", "prepare_s"), ("commit_s", "commit_s"), ("bytes_written", "bytes")):
        result[key] = first.get(theirs)
    result["cpu_s"] = {"commit": first.get("cpu_s", {})}
    result["work_dir"] = str(work) if keep else None
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


async def _checkpoints(
    deployment: Deployment,
    coordinator: Any,
    root: Path,
    in_flight: dict[str, None],
    every: float,
    duration: float,
    timeout: float,
    say: Any,
) -> list[dict[str, Any]]:
    """One checkpoint every ``every`` seconds for ``duration`` seconds (the first at once)."""
    taken: list[dict[str, Any]] = []
    slowest: dict[str, dict[str, float]] = {}

    def progress(report: Any) -> None:
        # The slowest reply of each kind per operation (the fan-out waits for it): where a pause goes.
        by_kind = slowest.setdefault(report.operation, {})
        kind = report.participant.kind
        by_kind[kind] = round(max(by_kind.get(kind, 0.0), report.elapsed), 4)

    coordinator.progress = progress
    began = time.monotonic()
    index = 0
    while (due := began + index * every) - began < duration:
        if (wait := due - time.monotonic()) > 0:
            await asyncio.sleep(wait)  # wait-ok: the fixed checkpoint interval
        checkpoint_id = f"periodic-{index}"
        directory = root / checkpoint_id
        size_before = bytes_under(root)
        figures: dict[str, Any] = {"index": index, "at_s": round(time.monotonic() - began, 3)}
        cpu: dict[str, float] = {}
        slowest.clear()
        t0 = time.monotonic()
        prepared = await prepare(coordinator, checkpoint_id, timeout=timeout)
        figures["prepare_s"] = round(time.monotonic() - t0, 4)
        if prepared.ready:
            scope = prepared.continued(list(in_flight))
            figures["in_flight"] = len(scope)
            figures["restarts"] = len(prepared.restarts())
            t1 = time.monotonic()
            with cpu_used({name: proc.pid for name, proc in deployment.processes.items()}, cpu):
                committed = await commit(coordinator, checkpoint_id, str(directory), scope, timeout=timeout)
            figures["commit_s"] = round(time.monotonic() - t1, 4)
            figures["exported"] = sum(
                len(reply.get("episode_ids") or ())
                for name, reply in committed.replies.items()
                if name.startswith(ENVIRONMENT)
            )
        else:
            figures["not_ready"] = prepared.to_json().get("blockers")
        t2 = time.monotonic()
        await resume(coordinator, checkpoint_id, timeout=timeout)
        figures["resume_s"] = round(time.monotonic() - t2, 4)
        figures["pause_s"] = round(time.monotonic() - t0, 4)
        figures["bytes"] = bytes_under(root) - size_before
        figures["cpu_s"] = cpu
        figures["per_kind_s"] = {operation: dict(kinds) for operation, kinds in slowest.items()}
        taken.append(figures)
        say(
            f"checkpoint {index}: pause {figures['pause_s']}s (prepare {figures['prepare_s']}s, commit "
            f"{figures.get('commit_s')}s), {figures.get('in_flight')} in flight, {figures['bytes']} bytes"
        )
        index += 1
    if (rest := began + duration - time.monotonic()) > 0:
        await asyncio.sleep(rest)  # wait-ok: the window's end (the share is over D seconds of wall time)
    return taken
