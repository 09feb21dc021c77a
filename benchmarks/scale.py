"""Checkpoint thousands of rollouts in flight on the real deployment, SIGKILL it, restore, and finish them all.

For each N in ``--rollouts`` (default 1000): the testing kit's deployment (the fake inference
backend, Gym's ``vllm_model``, ``simple_agent``, ``example_single_tool_call`` and
``single_agent_turn``, every server wrapped, checkpointing on) in fresh processes; the fake
backend holds each rollout's second model call (its answer after the tool call), so every
dispatched rollout stays in flight inside its agent turn. Then:

1. send N ``/run`` calls, round-robin over ``--replicas`` environment servers (each chain
   environment -> agent -> model its own processes; one resources server, one fake backend),
   at most ``--max-in-flight`` open at once in all: file descriptors bound how many rollouts
   one process can hold (see "File descriptors" below and docs/performance.md); paced so that
   at most ``--dispatch-window`` rollouts are on their way to the held call at once (a burst of
   thousands of connects overflows the servers' listen queues);
2. once every dispatched rollout's call is held: prepare, then commit the rollouts the
   prepare reports continuable (timed, total and per participant kind);
3. SIGKILL every process group, start fresh processes, restore (timed) and resume;
4. retire what the restore did not return, send every rollout again as its next attempt
   (at most ``--dispatch-window`` open at once), and wait for every reply (replacement
   failures are counted, never hidden).

Printed per N: rollouts in flight at the checkpoint, episodes exported (summed over the
environment replicas), prepare, commit and restore seconds (total, per participant kind: the
slowest reply of that kind across replicas, and per server), the CPU seconds each server used
during the commit and the restore call (``cpu_s``), bytes written, the peak RSS and
the open file descriptors at the checkpoint of each server, the kernel's listen-queue overflows
during the run, its packet losses during dispatch and during the replacements (``net_losses``:
input-queue drops, TCP retransmissions), replacement failures, and the episodes whose final
cleanup Gym's environments logged as timed out (``cleanup_timeouts``). The last line is one JSON
object ``{"runs": [...]}`` with those figures, one entry per N.

File descriptors: each rollout held inside its agent turn keeps two sockets open in its
environment, agent and model servers (caller and callee side), one in the fake backend and one
here, in the controller (its ``/run`` call). Under a limit of L descriptors per process (20,000
here, the hard limit) a chain holds at most ``--max-in-flight-per-process`` rollouts (default
9,000, room left for listeners, logs and the control plane), so ``--replicas`` defaults to
ceil(N / 9,000) and ``--max-in-flight`` to every rollout the replicas can hold; the backend and
this controller hold one descriptor per rollout in flight in all, so the total must stay under
L too (checked before starting: 16,000 fits, ~19,500 is the most on one controller).

    .venv/bin/python benchmarks/scale.py --rollouts 1000 8000 16000 [--step-mode replay] [--replicas K]
        [--model-workers W]

With ``--model-workers W`` every model server runs ``num_workers: W`` (uvicorn's supervisor and W
workers behind its port, one participant: docs/protocol.md section 9a), as NeMo Gym's published
16,000-row table ran its policy model; the per-process figures then name each worker
``"<server>/<pid>"`` beside its supervisor.

With ``--checkpoint-every S --duration D`` (``scale_periodic.py``): nothing is held or killed; N
rollouts progress and a checkpoint is taken every S seconds for D seconds: each one's pause
(admission closed, prepare to resume) and bytes, ``pause_s_max``, ``pause_share`` and
``bytes_incremental`` in each run's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import resource
import secrets
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import aiohttp

from nemo_gym_checkpoint_plugin.coordination import Progress, commit, discover, prepare, restore, resume, retire
from nemo_gym_checkpoint_plugin.testing.crash_scenario import WORKER_HEALTHCHECK_SECONDS, run_body
from nemo_gym_checkpoint_plugin.testing.deployment import (
    BACKEND,
    ENVIRONMENT,
    Deployment,
    free_port_base,
    port_span,
    replica_name,
)
from nemo_gym_checkpoint_plugin.testing.gym_config import DEFAULT_CHECKPOINT_BLOCK, TOKEN_ENV, wrapped_entrypoints

sys.path.insert(0, str(Path(__file__).parent))
from process_stats import (  # noqa: E402
    bytes_under,
    counters_since,
    cpu_used,
    listen_overflows,
    net_counters,
    open_fds,
    peak_rss_mb,
    with_children,
)
from sampling import sampled, write_summaries  # noqa: E402  (sibling scripts, not a package)
from scale_periodic import DEFAULT_RAMP_RATE, run_periodic  # noqa: E402

# Each rollout held in its agent turn keeps two sockets open in the environment, agent and model
# servers (caller and callee side); 20,000 descriptors per process (this machine's hard limit) then
# hold at most ~9,500 rollouts, with room for logs, listeners and the control plane.
DEFAULT_MAX_IN_FLIGHT_PER_PROCESS = 9_000
# Descriptors kept aside in a process holding one socket per rollout (the backend, this controller):
# its listener or control sessions, logs, the event loop, imported libraries.
_RESERVED_FDS = 500
# Gym's per-server aiohttp pool queues calls beyond 1,024 per host: sized to the work instead.
# Gym's TCP keepalive (idle 60 s, a probe every 10 s, dropped after 3 unanswered) on ~100,000 loopback
# sockets sends thousands of probes a second; on 2 busy cores the kernel's per-CPU input queue
# (net.core.netdev_max_backlog, 1,000) drops some, and a held rollout whose 3 probes in a row were
# dropped is aborted (ClientOSError, 499): at 16,000 rollouts about 6,000 were. Fewer probes, and
# more of them before giving up, keep dead-peer detection (docs/performance.md).
GYM_SETTINGS = {
    "global_aiohttp_connector_limit": 0,
    "global_aiohttp_connector_limit_per_host": 0,
    "global_aiohttp_tcp_keepalive_idle_seconds": 600,
    "global_aiohttp_tcp_keepalive_interval_seconds": 30,
    "global_aiohttp_tcp_keepalive_probes": 10,
}
# The environment's cleanup timeout (a session close within an episode, and the final unwind): Gym ships
# 180 s; the testing kit's 30 s (tests that fail fast) was crossed by a few agent-session closes while
# 1,000 replacements queued on 2 cores (a "cleanup" failure with an empty reason: its TimeoutError).
ENVIRONMENT_SETTINGS = {"cleanup_timeout_seconds": 180}
_POLL = 0.1
# Rollouts on their way to the held call at once (and replacement calls open at once): well under the
# servers' listen backlog (uvicorn's 2,048) however the rollouts split over the replicas.
DEFAULT_DISPATCH_WINDOW = 1_000
# Samples per second per server during checkpoint and restore with --profile (--profile-rate).
PROFILE_RATE = 1000


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := await check()):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(_POLL)  # wait-ok: poll interval of a bounded wait on a condition
    return value


class KindTimes:
    """Per participant kind (the longest reply across replicas: the fan-out waits for the slowest) and per server."""

    def __init__(self) -> None:
        self.seconds: dict[str, dict[str, float]] = defaultdict(dict)
        self.by_server: dict[str, dict[str, float]] = defaultdict(dict)

    def __call__(self, progress: Progress) -> None:
        by_kind = self.seconds[progress.operation]
        kind = progress.participant.kind
        by_kind[kind] = round(max(by_kind.get(kind, 0.0), progress.elapsed), 4)
        self.by_server[progress.operation][progress.participant.name] = round(progress.elapsed, 4)


def plan(
    rollouts: int, replicas: int | None, max_in_flight: int | None, per_process: int, fd_limit: int
) -> tuple[int, int]:
    """``(replicas, max in flight in all)`` for N rollouts; ``ValueError`` when a process would pass its fd limit.

    Each chain's processes hold two descriptors per rollout in flight through it, so one chain
    holds ``per_process`` at most; the backend and the controller hold one per rollout in flight in all.
    """
    if per_process < 1 or (replicas is not None and replicas < 1) or (max_in_flight is not None and max_in_flight < 1):
        raise ValueError("--replicas, --max-in-flight and --max-in-flight-per-process must be >= 1")
    replicas = replicas or max(1, math.ceil(rollouts / per_process))
    # By default every rollout the chains hold, and no more than the backend and this controller can.
    max_in_flight = max_in_flight or min(rollouts, per_process * replicas, fd_limit - _RESERVED_FDS)
    per_chain = math.ceil(min(max_in_flight, rollouts) / replicas)
    if per_chain > per_process:
        raise ValueError(
            f"{per_chain} rollouts in flight per replica chain (--max-in-flight {max_in_flight} over "
            f"{replicas} replicas) exceeds --max-in-flight-per-process {per_process}: add replicas"
        )
    single = min(max_in_flight, rollouts) + _RESERVED_FDS
    if single > fd_limit:
        raise ValueError(
            f"{min(max_in_flight, rollouts)} rollouts in flight need ~{single} descriptors in the fake backend "
            f"and in this controller (one per rollout), above the limit of {fd_limit}: lower --max-in-flight"
        )
    return replicas, max_in_flight


def _pids(deployment: Deployment) -> dict[str, int]:
    """Every server's process, and its uvicorn workers when it has several (``"<name>/<pid>"``)."""
    return with_children({name: proc.pid for name, proc in deployment.processes.items()})


def _phase(deployment: Deployment, profile: Path | None, phase: str, rate: int) -> Any:
    """Sample every server with py-spy while ``phase`` runs when ``--profile`` asks for it."""
    if profile is None:
        return contextlib.nullcontext()
    return sampled(_pids(deployment), profile, phase, rate)


def cleanup_timeouts(log_dir: Path, env_names: list[str]) -> int:
    """How many episodes' final cleanup Gym's environments logged as timed out (their rollout may have finished)."""
    count = 0
    for name in env_names:
        with contextlib.suppress(OSError):
            count += (log_dir / f"{name}.log").read_text(errors="replace").count("Episode cleanup timed out")
    return count


async def run_once(
    rollouts: int,
    max_in_flight: int,
    step_mode: str,
    timeout: float,
    keep: bool,
    profile: Path | None = None,
    replicas: int = 1,
    window: int = DEFAULT_DISPATCH_WINDOW,
    profile_rate: int = PROFILE_RATE,
    token_capture: bool = False,
    model_workers: int = 1,
) -> dict[str, Any]:
    if profile is not None:
        profile = profile / (f"{rollouts}-capture" if token_capture else str(rollouts))
    work = Path(tempfile.mkdtemp(prefix=f"ng-scale-{rollouts}-"))
    token = secrets.token_urlsafe(24)
    captures = work / "captures"
    gym_settings: dict[str, Any] = dict(GYM_SETTINGS)
    if token_capture:
        # Gym's run-wide capture directory, written by every model replica; the trainer's rebuild reads it.
        gym_settings["token_id_capture"] = {"enabled": True, "all_agents": True, "dir": str(captures)}
    model: dict[str, Any] = {"return_token_id_information": True} if token_capture else {}
    if model_workers > 1:
        # Each model server (every replica) as one participant over several uvicorn workers (docs/protocol.md
        # section 9a); its workers import Gym on these 2 cores before they answer uvicorn's health ping.
        model["num_workers"] = model_workers
        gym_settings["uvicorn_timeout_worker_healthcheck"] = WORKER_HEALTHCHECK_SECONDS
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
        environment=ENVIRONMENT_SETTINGS,
        model=model or None,
    )
    _LIVE.append(deployment)
    ids = [f"scale-{i}" for i in range(rollouts)]
    checkpoint_dir = work / "checkpoint"
    times = KindTimes()
    cpu: dict[str, dict[str, float]] = {"commit": {}, "restore": {}}
    result: dict[str, Any] = {
        "rollouts": rollouts,
        "step_mode": step_mode,
        "replicas": replicas,
        "max_in_flight": max_in_flight,
        "dispatch_window": window,
        "token_capture": token_capture,
        "model_workers": model_workers,
    }
    env_names = [replica_name(ENVIRONMENT, i) for i in range(1, replicas + 1)]
    overflows_before = listen_overflows()
    net_before = net_counters()
    net: dict[str, Any] = {}
    result["net_losses"] = net
    await asyncio.to_thread(deployment.start, 300.0)
    try:
        envs, backend = deployment.replica_urls(ENVIRONMENT), deployment.urls[BACKEND]
        # Round-robin: rollout j runs through chain j mod K, its replacement through the same chain
        # (the one that restored it).
        chain = {r: envs[j % replicas] for j, r in enumerate(ids)}
        # One pool sized to the work: at most max_in_flight /run calls open in all and no chain past its
        # share; the rest wait for a connection (no pool timeout: connect=None; only the socket connect
        # itself is bounded). aiohttp keys hosts by port too, so the per-host limit is per replica.
        limits = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=timeout, sock_read=None)
        connector = aiohttp.TCPConnector(limit=max_in_flight, limit_per_host=math.ceil(max_in_flight / replicas))
        async with aiohttp.ClientSession(timeout=limits, connector=connector) as http:
            control = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout))

            async def counts() -> dict[str, int]:
                async with control.get(backend + "/_fake/stats", params={"brief": "true"}) as reply:
                    return await reply.json()

            async def run(rollout_id: str, attempt: int) -> dict[str, Any]:
                async with http.post(chain[rollout_id] + "/run", json=run_body(rollout_id, attempt)) as reply:
                    body = await reply.json(content_type=None)
                    return body if reply.status == 200 else {"failure": {"status": reply.status, "body": body}}

            try:
                async with control.post(backend + "/_fake/hold", json={"match": "", "count": rollouts, "step": 1}):
                    pass
                started = time.monotonic()
                first: list[asyncio.Future[Any]] = []
                in_flight = min(rollouts, max_in_flight)
                with _phase(deployment, profile, "dispatch", rate=100):
                    await _dispatch(
                        ids, lambda r: asyncio.ensure_future(run(r, 0)), first, counts, in_flight, window, timeout
                    )
                early = [t.result() for t in first if t.done() and not t.cancelled() and t.exception() is None]
                result["dispatch_failures"] = sum(1 for body in early if body.get("failure") is not None)
                result["dispatch_s"] = round(time.monotonic() - started, 3)
                net["dispatch"] = counters_since(net_before)
                result["in_flight"] = (await counts())["held"]
                result["open_fds"] = open_fds(_pids(deployment))
                _say(f"[{rollouts}] {result['in_flight']} rollouts in flight (held) after {result['dispatch_s']}s")

                coordinator = await discover(deployment.config, token)
                coordinator.progress = times
                async with coordinator, _async(_phase(deployment, profile, "checkpoint", profile_rate)):
                    t0 = time.monotonic()
                    prepared = await prepare(coordinator, "scale", timeout=timeout)
                    result["prepare_s"] = round(time.monotonic() - t0, 4)
                    if not prepared.ready:
                        raise RuntimeError(f"prepare not ready: {prepared.to_json()}")
                    scope = prepared.continued(ids)
                    t0 = time.monotonic()
                    with cpu_used(_pids(deployment), cpu["commit"]):
                        committed = await commit(coordinator, "scale", str(checkpoint_dir), scope, timeout=timeout)
                    result["commit_s"] = round(time.monotonic() - t0, 4)
                    result["exported"] = sum(len(committed.replies[name]["episode_ids"]) for name in env_names)
                result["bytes_written"] = bytes_under(checkpoint_dir)
                result["peak_rss_mb"] = peak_rss_mb(_pids(deployment))
                _say(
                    f"[{rollouts}] prepare {result['prepare_s']}s, commit {result['commit_s']}s, "
                    f"{result['exported']} episodes exported, {result['bytes_written']} bytes"
                )

                deployment.kill()
                await asyncio.gather(*first, return_exceptions=True)
                await asyncio.to_thread(deployment.start, 300.0)
                coordinator = await discover(deployment.config, token)
                coordinator.progress = times
                async with coordinator, _async(_phase(deployment, profile, "restore", profile_rate)):
                    t0 = time.monotonic()
                    with cpu_used(_pids(deployment), cpu["restore"]):
                        restored = await restore(
                            coordinator, "scale-restore", str(checkpoint_dir), scope, timeout=timeout
                        )
                    result["restore_s"] = round(time.monotonic() - t0, 4)
                    await resume(coordinator, "scale-restore", timeout=timeout)
                    back = {
                        key.rsplit("-a", 1)[0]
                        for name in env_names
                        for key in restored.replies[name].get("restored") or []
                    }
                    result["restored"] = len(back)
                    others = [{"rollout_id": r, "attempt": 0} for r in ids if r not in back]
                    if others:
                        await retire(coordinator, "scale-retire", others, timeout=timeout)
                _say(f"[{rollouts}] restore {result['restore_s']}s ({len(back)} continued); running every rollout")
                t0 = time.monotonic()
                net_replacing = net_counters()
                # A bounded number of replacement /run calls open at once: a controller's concurrency, and
                # no burst of thousands of connects at one listen queue.
                gate = asyncio.Semaphore(window)

                async def replacement(rollout_id: str) -> dict[str, Any]:
                    async with gate:
                        return await run(rollout_id, 1)

                replies = await asyncio.gather(*(replacement(r) for r in ids), return_exceptions=True)
                result["replacement_s"] = round(time.monotonic() - t0, 3)
                net["replacements"] = counters_since(net_replacing)
                result["cleanup_timeouts"] = cleanup_timeouts(work / "logs", env_names)
                failed = [r for r in replies if isinstance(r, BaseException) or r.get("failure") is not None]
                result["replacement_failures"] = len(failed)
                result["finished"] = sum(
                    1
                    for r in replies
                    if not isinstance(r, BaseException) and (r.get("result") or {}).get("reward") == 1.0
                )
                if failed:
                    result["first_failure"] = repr(failed[0])[:300]
                    # Gym answers a failed episode with 200 and its failure (stage, reason): counted by reason.
                    result["failure_reasons"] = dict(Counter(_reason(r) for r in failed).most_common(10))
                result["peak_rss_mb_replacements"] = peak_rss_mb(_pids(deployment))
                _say(
                    f"[{rollouts}] replacements: {result['finished']} finished, {len(failed)} failed, "
                    f"{result['cleanup_timeouts']} cleanup timeouts, network losses {net['replacements']}"
                )
                if token_capture:
                    result["capture"] = await asyncio.to_thread(rebuilt, captures, [f"{r}-a1" for r in ids])
                    _say(f"[{rollouts}] Gym's rebuild of every continued rollout: {result['capture']}")
            finally:
                await control.close()
    finally:
        deployment.stop()
        _LIVE.remove(deployment)
        overflows_after = listen_overflows()
        if overflows_before is not None and overflows_after is not None:
            # Shared by every process of this network namespace: other work on the machine counts too.
            result["listen_overflows"] = overflows_after - overflows_before
    if profile is not None:
        for phase in ("dispatch", "checkpoint", "restore"):
            _say((write_summaries(profile, phase)).read_text())
        result["profile_dir"] = str(profile)
    result["per_kind_s"] = {op: times.seconds.get(op, {}) for op in ("prepare", "commit", "restore")}
    result["per_server_s"] = {op: times.by_server.get(op, {}) for op in ("prepare", "commit", "restore")}
    # CPU seconds each server (and this controller) used during the commit and the restore call: on 2 cores
    # a phase lasts at least its total over 2, whatever the slowest server's own share.
    result["cpu_s"] = cpu
    result["work_dir"] = str(work) if keep else None
    if not keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return result


# Each rollout's turn: one tool call, then the answer (two model calls); the first is restored, the second
# (held at the crash) sent again.
_CALLS_PER_TURN = 2


def rebuilt(captures: Path, keys: list[str]) -> dict[str, Any]:
    """Gym's own rebuild (``trajectories_for_rollout``) of every continued rollout: how many masked or miscounted."""
    from nemo_gym.token_id_capture import trajectories_for_rollout

    masked, wrong = [], []
    for key in keys:
        built = trajectories_for_rollout(key, [captures]) or {}
        if built.get("mask_sample", True):
            masked.append(key)
        if (built.get("metrics") or {}).get("n_calls") != _CALLS_PER_TURN:
            wrong.append(key)
    return {"rebuilt": len(keys), "masked": len(masked), "n_calls_wrong": len(wrong), "first_bad": (masked + wrong)[:3]}


def _reason(reply: Any) -> str:
    if isinstance(reply, BaseException):
        return f"{type(reply).__name__}: {reply}"[:120]
    failure = reply.get("failure") or {}
    where, why = failure.get("stage") or failure.get("status"), failure.get("failure_reason") or failure.get("body")
    return f"{where}: {why}"[:120]


@contextlib.asynccontextmanager
async def _async(manager: Any) -> Any:
    with manager:
        yield


async def _dispatch(
    ids: list[str], start: Any, started: list[asyncio.Future[Any]], counts: Any, target: int, window: int, stall: float
) -> None:
    """Start rollouts so that at most ``window`` are on their way to the held call at once, until ``target`` are held.

    Thousands of ``/run`` calls started in one instant arrive as thousands of connects at one listen
    queue, then at the agents', then the model servers' (each overflows past its backlog, 2,048 with
    uvicorn, and the kernel retries or resets the connections): a controller paces them. A rollout
    that ended before its call was held (a failure) frees its place. ``stall`` bounds a wait without
    progress, not the whole dispatch (16,000 rollouts take minutes here).
    """
    progress_at, best = time.monotonic(), -1
    while True:
        held = (await counts())["held"]
        ended = sum(1 for task in started if task.done())
        if held >= target or (len(started) == len(ids) and held + ended >= len(ids)):
            return
        room = min(held + ended + window - len(started), len(ids) - len(started))
        started.extend(start(rollout_id) for rollout_id in ids[len(started) : len(started) + max(room, 0)])
        if held + ended > best:
            progress_at, best = time.monotonic(), held + ended
        elif time.monotonic() - progress_at > stall:
            raise TimeoutError(f"no progress for {stall}s: {held} held, {ended} ended, {len(started)} started")
        await asyncio.sleep(_POLL)  # wait-ok: poll interval of a bounded wait on a condition


# The deployment of the run under way: a SIGTERM or Ctrl-C kills it before the benchmark exits.
_LIVE: list[Deployment] = []


def _stop_on_signal(signum: int, _frame: Any) -> None:
    for other in (signal.SIGTERM, signal.SIGINT):
        signal.signal(other, signal.SIG_IGN)  # a second signal must not cut this short
    for deployment in list(_LIVE):
        deployment.kill()
    _say(f"stopped by {signal.Signals(signum).name}; every server of the run killed")
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, nargs="+", default=[1000], help="N per run (default 1000)")
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="environment -> agent -> model chains, rollouts dispatched round-robin over them "
        "(default ceil(N / --max-in-flight-per-process))",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="most /run calls open at once over all replicas (default: every rollout the replicas can hold, N at most)",
    )
    parser.add_argument(
        "--max-in-flight-per-process",
        type=int,
        default=DEFAULT_MAX_IN_FLIGHT_PER_PROCESS,
        help="most rollouts one replica chain holds: two descriptors each in its servers "
        f"(default {DEFAULT_MAX_IN_FLIGHT_PER_PROCESS}, for a limit of 20,000)",
    )
    parser.add_argument(
        "--dispatch-window",
        type=int,
        default=DEFAULT_DISPATCH_WINDOW,
        help="most rollouts started and not yet held at once, and most replacement /run calls "
        f"open at once (default {DEFAULT_DISPATCH_WINDOW})",
    )
    parser.add_argument(
        "--model-workers",
        type=int,
        default=1,
        metavar="W",
        help="uvicorn workers of each model server (default 1; NeMo Gym's published 16,000 table ran 2)",
    )
    parser.add_argument("--step-mode", choices=("wait", "replay"), default="replay")
    parser.add_argument("--timeout", type=float, default=600.0, help="bound of each wait, seconds")
    parser.add_argument("--keep", action="store_true", help="keep each run's work directory (logs, checkpoint)")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="sample every server with py-spy during dispatch, checkpoint and restore; "
        "collapsed stacks and summaries under DIR/<N>/",
    )
    parser.add_argument(
        "--token-capture",
        action="store_true",
        help="run each N twice, token capture off then on (Gym's token_id_capture, its run-wide "
        "directory shared by the model replicas): the restore figures side by side, and "
        "Gym's rebuild of every continued rollout checked",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=float,
        default=None,
        metavar="S",
        help="periodic mode (scale_periodic.py): nothing held, rollouts progressing, a checkpoint every S "
        "seconds for --duration seconds; each pause and its share of wall time, bytes per checkpoint",
    )
    parser.add_argument("--duration", type=float, default=300.0, metavar="D", help="periodic mode's window (s)")
    parser.add_argument(
        "--generation-seconds",
        type=float,
        default=None,
        help="periodic mode: each model call's wait at the backend (default N / 50 s, at least 5)",
    )
    parser.add_argument(
        "--ramp-rate",
        type=float,
        default=DEFAULT_RAMP_RATE,
        help=f"periodic mode: rollout slots started per second (default {DEFAULT_RAMP_RATE:g})",
    )
    parser.add_argument(
        "--profile-rate",
        type=int,
        default=PROFILE_RATE,
        help=f"py-spy samples per second per server in checkpoint and restore (default {PROFILE_RATE}; "
        "on 2 cores, a lower rate disturbs the timed figures less)",
    )
    args = parser.parse_args(argv)
    if args.profile_rate < 1:
        parser.error("--profile-rate must be at least 1")
    if args.dispatch_window < 1:
        parser.error("--dispatch-window must be at least 1")
    if args.model_workers < 1:
        parser.error("--model-workers must be at least 1")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop_on_signal)
    fd_limit = _raise_fd_limit()
    plans = {}
    for n in args.rollouts:
        try:
            plans[n] = plan(n, args.replicas, args.max_in_flight, args.max_in_flight_per_process, fd_limit)
        except ValueError as exc:
            parser.error(f"--rollouts {n}: {exc}")
    runs = []
    if args.checkpoint_every is not None:
        if args.checkpoint_every <= 0 or args.duration <= 0 or args.ramp_rate <= 0:
            parser.error("--checkpoint-every, --duration and --ramp-rate must be positive")
        if args.token_capture or args.profile is not None or args.model_workers > 1:
            parser.error("--checkpoint-every runs without --token-capture, --profile and --model-workers")
        for n in args.rollouts:
            _say(f"[{n}] periodic: {plans[n][0]} replica chain(s), a checkpoint every {args.checkpoint_every:g}s")
            run = asyncio.run(
                run_periodic(
                    n,
                    plans[n][0],
                    args.step_mode,
                    args.timeout,
                    args.checkpoint_every,
                    args.duration,
                    generation_seconds=args.generation_seconds,
                    ramp_rate=args.ramp_rate,
                    keep=args.keep,
                    gym_settings=GYM_SETTINGS,
                    environment=ENVIRONMENT_SETTINGS,
                    live=_LIVE,
                    say=_say,
                )
            )
            runs.append(run)
            print(json.dumps(run), flush=True)
        print(json.dumps({"runs": runs}))
        return 0 if all(r["failed"] == 0 and r["checkpoints_taken"] > 0 for r in runs) else 1
    for n in args.rollouts:
        replicas, max_in_flight = plans[n]
        for capture in (False, True) if args.token_capture else (False,):
            _say(
                f"[{n}] {replicas} replica chain(s), at most {max_in_flight} rollouts in flight "
                f"(file descriptor limit {fd_limit} per process), token capture {'on' if capture else 'off'}, "
                f"{args.model_workers} uvicorn worker(s) per model server"
            )
            run = asyncio.run(
                run_once(
                    n,
                    max_in_flight,
                    args.step_mode,
                    args.timeout,
                    args.keep,
                    args.profile,
                    replicas,
                    args.dispatch_window,
                    args.profile_rate,
                    capture,
                    args.model_workers,
                )
            )
            runs.append(run)
            print(json.dumps(run), flush=True)
    print(json.dumps({"runs": runs}))
    good = all(
        r["replacement_failures"] == 0
        and not (r.get("capture") or {}).get("masked")
        and not (r.get("capture") or {}).get("n_calls_wrong")
        for r in runs
    )
    return 0 if good else 1


def _raise_fd_limit() -> int:
    """Raise this process's soft descriptor limit to its hard one (the servers inherit it); return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    sys.exit(main())
