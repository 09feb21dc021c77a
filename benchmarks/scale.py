"""Checkpoint thousands of rollouts in flight on the real deployment, SIGKILL it, restore, and finish them all.

For each N in ``--rollouts`` (default 1000): the testing kit's deployment (the fake inference
backend, Gym's ``vllm_model``, ``simple_agent``, ``example_single_tool_call`` and
``single_agent_turn``, every server wrapped, checkpointing on) in fresh processes; the fake
backend holds each rollout's second model call (its answer after the tool call), so every
dispatched rollout stays in flight inside its agent turn. Then:

1. send N ``/run`` calls (at most ``--max-in-flight`` open at once: the servers' file
   descriptors bound how many rollouts one process can hold, see docs/performance.md);
2. once every dispatched rollout's call is held: prepare, then commit the rollouts the
   prepare reports continuable (timed, total and per participant kind);
3. SIGKILL every process group, start fresh processes, restore (timed) and resume;
4. retire what the restore did not return, send every rollout again as its next attempt,
   and wait for every reply (replacement failures are counted, never hidden).

Printed per N: rollouts in flight at the checkpoint, episodes exported, prepare, commit and
restore seconds (total and per participant kind), bytes written, the peak RSS of each server
(first processes and replacements), replacement failures. The last line is one JSON object
``{"runs": [...]}`` with those figures, one entry per N.

    .venv/bin/python benchmarks/scale.py --rollouts 1000 8000 16000 [--step-mode replay]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp

from nemo_gym_checkpoint_plugin.coordination import Progress, commit, discover, prepare, restore, resume, retire
from nemo_gym_checkpoint_plugin.testing.crash_scenario import run_body
from nemo_gym_checkpoint_plugin.testing.deployment import BACKEND, ENVIRONMENT, Deployment, free_port_base
from nemo_gym_checkpoint_plugin.testing.gym_config import DEFAULT_CHECKPOINT_BLOCK, TOKEN_ENV, wrapped_entrypoints

sys.path.insert(0, str(Path(__file__).parent))
from sampling import sampled, write_summaries  # noqa: E402  (a sibling script, not a package)

# Each rollout held in its agent turn keeps two sockets open in the environment, agent and model
# servers (caller and callee side); 20,000 descriptors per process (this machine's hard limit) then
# hold at most ~9,500 rollouts, with room for logs, listeners and the control plane.
DEFAULT_MAX_IN_FLIGHT = 9_000
# Gym's per-server aiohttp pool queues calls beyond 1,024 per host: sized to the work instead.
GYM_SETTINGS = {"global_aiohttp_connector_limit": 0, "global_aiohttp_connector_limit_per_host": 0}
_POLL = 0.1


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _peak_rss_mb(deployment: Deployment) -> dict[str, float]:
    """Peak resident memory (VmHWM) of each live server process, in MiB."""
    peaks = {}
    for name, proc in deployment.processes.items():
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                peaks[name] = round(int(line.split()[1]) / 1024, 1)
    return peaks


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


async def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := await check()):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(_POLL)  # wait-ok: poll interval of a bounded wait on a condition
    return value


class KindTimes:
    """Per participant kind: the longest reply time of each operation (the fan-out waits for the slowest)."""

    def __init__(self) -> None:
        self.seconds: dict[str, dict[str, float]] = defaultdict(dict)

    def __call__(self, progress: Progress) -> None:
        by_kind = self.seconds[progress.operation]
        kind = progress.participant.kind
        by_kind[kind] = round(max(by_kind.get(kind, 0.0), progress.elapsed), 4)


def _phase(deployment: Deployment, profile: Path | None, phase: str, rate: int = 1000) -> Any:
    """Sample every server with py-spy while ``phase`` runs when ``--profile`` asks for it."""
    if profile is None:
        return contextlib.nullcontext()
    return sampled({name: proc.pid for name, proc in deployment.processes.items()}, profile, phase, rate)


async def run_once(rollouts: int, max_in_flight: int, step_mode: str, timeout: float, keep: bool,
                   profile: Path | None = None) -> dict[str, Any]:
    if profile is not None:
        profile = profile / str(rollouts)
    work = Path(tempfile.mkdtemp(prefix=f"ng-scale-{rollouts}-"))
    token = secrets.token_urlsafe(24)
    deployment = Deployment(
        free_port_base(), work, entrypoints=wrapped_entrypoints(), own_process_groups=True,
        log_dir=work / "logs", extra_env={TOKEN_ENV: token},
        checkpoint={**DEFAULT_CHECKPOINT_BLOCK, "step_mode": step_mode}, gym_settings=GYM_SETTINGS,
    )
    ids = [f"scale-{i}" for i in range(rollouts)]
    checkpoint_dir = work / "checkpoint"
    times = KindTimes()
    result: dict[str, Any] = {"rollouts": rollouts, "step_mode": step_mode, "max_in_flight": max_in_flight}
    await asyncio.to_thread(deployment.start, 300.0)
    try:
        env, backend = deployment.urls[ENVIRONMENT], deployment.urls[BACKEND]
        # One pool sized to the work: at most max_in_flight /run calls open, the rest wait for a
        # connection (no pool timeout: connect=None; only the socket connect itself is bounded).
        limits = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=timeout, sock_read=None)
        connector = aiohttp.TCPConnector(limit=max_in_flight, limit_per_host=max_in_flight)
        async with aiohttp.ClientSession(timeout=limits, connector=connector) as http:
            control = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout))

            async def counts() -> dict[str, int]:
                async with control.get(backend + "/_fake/stats", params={"brief": "true"}) as reply:
                    return await reply.json()

            async def run(rollout_id: str, attempt: int) -> dict[str, Any]:
                async with http.post(env + "/run", json=run_body(rollout_id, attempt)) as reply:
                    body = await reply.json(content_type=None)
                    return body if reply.status == 200 else {"failure": {"status": reply.status, "body": body}}

            try:
                async with control.post(backend + "/_fake/hold", json={"match": "", "count": rollouts, "step": 1}):
                    pass
                started = time.monotonic()
                first = [asyncio.ensure_future(run(r, 0)) for r in ids]
                in_flight = min(rollouts, max_in_flight)
                with _phase(deployment, profile, "dispatch", rate=100):
                    await _wait(lambda: _at_least(counts, in_flight), timeout, f"{in_flight} held model calls")
                result["dispatch_s"] = round(time.monotonic() - started, 3)
                result["in_flight"] = (await counts())["held"]
                _say(f"[{rollouts}] {result['in_flight']} rollouts in flight (held) after {result['dispatch_s']}s")

                coordinator = await discover(deployment.config, token)
                coordinator.progress = times
                async with coordinator, _async(_phase(deployment, profile, "checkpoint")):
                    t0 = time.monotonic()
                    prepared = await prepare(coordinator, "scale", timeout=timeout)
                    result["prepare_s"] = round(time.monotonic() - t0, 4)
                    if not prepared.ready:
                        raise RuntimeError(f"prepare not ready: {prepared.to_json()}")
                    scope = prepared.continued(ids)
                    t0 = time.monotonic()
                    committed = await commit(coordinator, "scale", str(checkpoint_dir), scope, timeout=timeout)
                    result["commit_s"] = round(time.monotonic() - t0, 4)
                    result["exported"] = len(committed.replies[ENVIRONMENT]["episode_ids"])
                result["bytes_written"] = _bytes_under(checkpoint_dir)
                result["peak_rss_mb"] = _peak_rss_mb(deployment)
                _say(f"[{rollouts}] prepare {result['prepare_s']}s, commit {result['commit_s']}s, "
                     f"{result['exported']} episodes exported, {result['bytes_written']} bytes")

                deployment.kill()
                await asyncio.gather(*first, return_exceptions=True)
                await asyncio.to_thread(deployment.start, 300.0)
                coordinator = await discover(deployment.config, token)
                coordinator.progress = times
                async with coordinator, _async(_phase(deployment, profile, "restore")):
                    t0 = time.monotonic()
                    restored = await restore(coordinator, "scale-restore", str(checkpoint_dir), scope,
                                             timeout=timeout)
                    result["restore_s"] = round(time.monotonic() - t0, 4)
                    await resume(coordinator, "scale-restore", timeout=timeout)
                    back = {key.rsplit("-a", 1)[0] for key in restored.replies[ENVIRONMENT].get("restored") or []}
                    result["restored"] = len(back)
                    others = [{"rollout_id": r, "attempt": 0} for r in ids if r not in back]
                    if others:
                        await retire(coordinator, "scale-retire", others, timeout=timeout)
                _say(f"[{rollouts}] restore {result['restore_s']}s ({len(back)} continued); running every rollout")
                t0 = time.monotonic()
                replies = await asyncio.gather(*(run(r, 1) for r in ids), return_exceptions=True)
                result["replacement_s"] = round(time.monotonic() - t0, 3)
                failed = [r for r in replies if isinstance(r, BaseException) or r.get("failure") is not None]
                result["replacement_failures"] = len(failed)
                result["finished"] = sum(
                    1 for r in replies if not isinstance(r, BaseException) and r.get("result", {}).get("reward") == 1.0
                )
                if failed:
                    result["first_failure"] = repr(failed[0])[:300]
                result["peak_rss_mb_replacements"] = _peak_rss_mb(deployment)
            finally:
                await control.close()
    finally:
        deployment.stop()
    if profile is not None:
        for phase in ("dispatch", "checkpoint", "restore"):
            _say((write_summaries(profile, phase)).read_text())
        result["profile_dir"] = str(profile)
    result["per_kind_s"] = {op: times.seconds.get(op, {}) for op in ("prepare", "commit", "restore")}
    result["work_dir"] = str(work) if keep else None
    if not keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return result


@contextlib.asynccontextmanager
async def _async(manager: Any) -> Any:
    with manager:
        yield


async def _at_least(counts: Any, n: int) -> bool:
    return (await counts())["held"] >= n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, nargs="+", default=[1000], help="N per run (default 1000)")
    parser.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT,
                        help=f"most /run calls open at once (default {DEFAULT_MAX_IN_FLIGHT})")
    parser.add_argument("--step-mode", choices=("wait", "replay"), default="replay")
    parser.add_argument("--timeout", type=float, default=600.0, help="bound of each wait, seconds")
    parser.add_argument("--keep", action="store_true", help="keep each run's work directory (logs, checkpoint)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="sample every server with py-spy during dispatch, checkpoint and restore; "
                             "collapsed stacks and summaries under DIR/<N>/")
    args = parser.parse_args(argv)
    runs = []
    for n in args.rollouts:
        run = asyncio.run(run_once(n, args.max_in_flight, args.step_mode, args.timeout, args.keep, args.profile))
        runs.append(run)
        print(json.dumps(run), flush=True)
    print(json.dumps({"runs": runs}))
    return 0 if all(r["replacement_failures"] == 0 for r in runs) else 1


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    sys.exit(main())
