"""Requests/s through a small FastAPI app with the admission gate installed and idle, against the same app without it.

Each variant is served by its own real uvicorn process on 127.0.0.1 (both started
once, alive for the whole run). The gated one has admission open, the telemetry a
participant server has (its metrics watch the gate), and retired marks
for other rollouts, so every request takes the gate's real path (the marks make it
parse ``/ng-rollout/<key>`` paths and ``/run`` bodies), not only its fast path.
A bounded aiohttp client sends a fixed number of requests per round at fixed
concurrency, mixing a plain GET, a ``POST /run`` with a JSON body and a
``/ng-rollout/<key>/verify`` path (stripped by Gym's own RolloutContextMiddleware,
as on a resources server). The variants alternate for several rounds; inside a
round they alternate in bursts (order flipped each burst) so that both see the
same background load of a shared machine. The figure per variant is all its
requests over all its seconds. Then the gate's own CPU cost per request, measured
in-process around an app that does nothing. The last line is one JSON object.

With ``--workers N`` (N > 1) each variant is one server with N uvicorn workers behind one port,
the gated one run as a checkpointed server with ``num_workers: N`` runs: the coordinator in the
supervisor's process, each worker's gate (and the rest of the worker side) attached by the
plugin's own ``_workers`` code, the retired marks sent by a ``retire`` control call on the shared
port (``gate_workers.py``). Everything else, the figures and the JSON line (with ``"workers"``),
is the same.

    .venv/bin/python benchmarks/gate_overhead.py [--rounds 5] [--requests 4000] [--burst 1000] [--concurrency 32]
        [--workers N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import aiohttp
from fastapi import FastAPI
from nemo_gym.rollout_correlation import RolloutContextMiddleware
from pydantic import BaseModel, ConfigDict

from nemo_gym_checkpoint_plugin._admission import Admission, RetiredMarks
from nemo_gym_checkpoint_plugin._gate import install_gate
from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._telemetry.server import ServerTelemetry

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gate_workers import TOKEN_ENV, retire_others, serve_workers, wait_workers  # noqa: E402  (sibling scripts)
from process_stats import cpu_seconds, with_children  # noqa: E402

RETIRED_OTHER_ROLLOUTS = 200


class RunBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    episode_id: EpisodeId
    task: dict[str, Any]


def build_app(gated: bool) -> FastAPI:
    app = FastAPI()
    app.add_middleware(RolloutContextMiddleware)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/items")
    async def items() -> dict[str, int]:
        return {"count": 3}

    @app.post("/run")
    async def run(body: RunBody) -> dict[str, Any]:
        return {"episode_id": body.episode_id.model_dump(), "reward": 1.0}

    @app.post("/verify")
    async def verify(body: dict[str, Any]) -> dict[str, float]:
        return {"reward": 1.0}

    if gated:
        marks = RetiredMarks()
        for index in range(RETIRED_OTHER_ROLLOUTS):
            marks.mark(f"retired-{index}", 1)
        admission = Admission()
        counters = install_gate(app, admission, marks)
        # As on a participant server: the plane's telemetry watches the gate (parked requests, park times).
        telemetry = ServerTelemetry(
            "environment",
            "bench",
            active_operation=lambda: None,
            admission_open=lambda: admission.is_open,
            lease_expiries=lambda: 0,
        )
        telemetry.metrics.watch_gate(counters)
        app.state.bench_telemetry = telemetry
    return app


def _with_pid(app: FastAPI) -> FastAPI:
    @app.get("/pid")
    async def pid() -> dict[str, int]:
        return {"pid": os.getpid()}

    return app


def gated_worker_app() -> FastAPI:
    """One uvicorn worker's app of the gated server with several workers (uvicorn factory, ``gate_workers.py``).

    The worker side exactly as ``_attach.attach_checkpointing`` installs it in a worker of an environment
    server: this process's plugin manager (core plugins, the entry-point group) and ``attach_worker``.
    """
    from nemo_gym_checkpoint_plugin._plugins import make_plugin_manager
    from nemo_gym_checkpoint_plugin._workers.attach import attach_worker

    app = _with_pid(build_app(gated=False))
    attach_worker(app, make_plugin_manager(), kind="environment")
    return app


def plain_worker_app() -> FastAPI:
    """One uvicorn worker's app of the plain server with several workers (uvicorn factory)."""
    return _with_pid(build_app(gated=False))


def serve(gated: bool) -> None:
    """Child process: bind a free loopback port, report it on stdout, serve until killed."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(build_app(gated), log_level="warning", access_log=False)
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


def start_server(gated: bool, workers: int = 1, token: str = "") -> tuple[subprocess.Popen[str], str]:
    """The server process (its own process group: with workers, uvicorn's supervisor and its children)."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", TOKEN_ENV: token}
    argv = [sys.executable, __file__, "--serve-gated" if gated else "--serve-plain", "--workers", str(workers)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    assert proc.stdout is not None
    port = proc.stdout.readline().strip()
    if not port.isdigit():
        stop_server(proc)
        raise RuntimeError(f"server did not report its port (got {port!r})")
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen[str], grace: float = 15.0) -> None:
    """SIGTERM (uvicorn's supervisor stops its workers, the coordinator's runtime directory goes), then SIGKILL
    whatever of the process group is left."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


async def wait_ready(base: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(f"{base}/health") as reply:
                    if reply.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{base} not ready within {timeout}s")
            await asyncio.sleep(0.05)  # wait-ok: poll interval while the server starts (bounded)


def request_mix() -> list[tuple[str, str, bytes | None]]:
    run = json.dumps(
        {
            "episode_id": {"rollout_id": "live-7", "attempt": 0},
            "task": {"task_id": {"taskset": "bench", "task_id": "t1"}, "input": "solve it " * 20},
        }
    ).encode()
    return [
        ("GET", "/items", None),
        ("POST", "/run", run),
        ("POST", "/ng-rollout/live-7-a1/verify", b'{"response": {"output": []}}'),
    ]


async def load(base: str, total: int, concurrency: int) -> float:
    """Send ``total`` requests with ``concurrency`` workers; return the seconds taken. Every reply must be 200."""
    mix = request_mix()
    headers = {"content-type": "application/json"}
    next_index = 0
    failures: list[str] = []

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal next_index
        while next_index < total:
            method, path, body = mix[next_index % len(mix)]
            next_index += 1
            async with session.request(method, base + path, data=body, headers=headers) as reply:
                await reply.read()
                if reply.status != 200:
                    failures.append(f"{method} {path}: {reply.status}")

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed, first: {failures[0]}")
    return elapsed


async def measure(
    args: argparse.Namespace, servers: dict[str, tuple[subprocess.Popen[str], str]], token: str = ""
) -> tuple[int, dict[str, list[float]], dict[str, float]]:
    """Requests per round, per variant the seconds each round took to serve them, and its servers' CPU seconds.

    A round is split into bursts that alternate between the variants (order flipped each burst),
    so both see the same background load of a shared machine. The CPU seconds are every process
    of the variant's server (uvicorn's supervisor and its workers, with ``--workers``) over the
    counted bursts: what serving those requests cost, whatever else the machine runs.
    """
    bases = {name: base for name, (_, base) in servers.items()}
    for base in bases.values():
        await wait_ready(base)
    checks = 1
    if args.workers > 1:
        for name, base in bases.items():
            pids = await wait_workers(base, args.workers, gated=name == "with", token=token)
            print(f"{name}: {len(pids)} uvicorn workers behind one port (pids {pids})", flush=True)
        await retire_others(bases["with"], token, RETIRED_OTHER_ROLLOUTS)
        checks = 8 * args.workers  # each on its own connection: whichever worker accepts it
    processes = {name: with_children({name: proc.pid}) for name, (proc, _) in servers.items()}
    # Check the variants really differ: the gated server refuses a retired attempt, the plain one serves it.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for name, expected in (("with", 409), ("without", 200)):
            for _ in range(checks):
                async with session.post(f"{bases[name]}/ng-rollout/retired-0/verify", json={}) as reply:
                    if reply.status != expected:
                        raise RuntimeError(f"{name}: a retired attempt got {reply.status}, expected {expected}")
    for base in bases.values():
        await load(base, args.requests // 4, args.concurrency)  # warm-up, not counted
    bursts = max(1, args.requests // args.burst)
    per_burst = args.requests // bursts
    rounds: dict[str, list[float]] = {name: [] for name in bases}
    cpu = dict.fromkeys(bases, 0.0)
    for index in range(args.rounds):
        seconds = dict.fromkeys(bases, 0.0)
        for burst in range(bursts):
            order = list(bases) if (index * bursts + burst) % 2 == 0 else list(reversed(bases))
            for name in order:
                before = _server_cpu(processes[name])
                seconds[name] += await load(bases[name], per_burst, args.concurrency)
                cpu[name] += _server_cpu(processes[name]) - before
        for name in bases:
            rounds[name].append(seconds[name])
        figures = ", ".join(f"{name} {per_burst * bursts / seconds[name]:.0f} req/s" for name in bases)
        print(f"round {index + 1}: {figures}", flush=True)
    return per_burst * bursts, rounds, cpu


def _server_cpu(pids: dict[str, int]) -> float:
    return sum(seconds for name, seconds in cpu_seconds(pids).items() if name != "controller")


def gate_cost_us(calls: int = 20000) -> dict[str, float]:
    """In-process CPU cost of the gate alone per request (microseconds), around an app that does nothing.

    Independent of the machine's load far more than req/s are, so it says what the gate itself adds.
    """
    from nemo_gym_checkpoint_plugin._gate import AdmissionGate, GateCounters

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/run":
            await receive()

    run_body = request_mix()[1][2] or b""

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": run_body, "more_body": False}

    async def send(message: Any) -> None:
        return None

    retired = RetiredMarks()
    for index in range(RETIRED_OTHER_ROLLOUTS):
        retired.mark(f"retired-{index}", 1)
    cases = {
        "fast path (no marks), GET": (RetiredMarks(), "GET", "/items"),
        "marks present, GET": (retired, "GET", "/items"),
        "marks present, /ng-rollout path": (retired, "POST", "/ng-rollout/live-7-a1/verify"),
        "marks present, POST /run body": (retired, "POST", "/run"),
    }

    async def run() -> dict[str, float]:
        costs = {}
        for name, (marks, method, path) in cases.items():
            gate = AdmissionGate(app, admission=Admission(), marks=marks, counters=GateCounters())
            scope = {"type": "http", "method": method, "path": path}
            timings = []
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(calls):
                    await gate(scope, receive, send)
                gated = time.perf_counter() - start
                start = time.perf_counter()
                for _ in range(calls):
                    await app(scope, receive, send)
                bare = time.perf_counter() - start
                timings.append((gated - bare) / calls * 1e6)
            costs[name] = min(timings)
        return costs

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=4000, help="requests per round and variant")
    parser.add_argument("--burst", type=int, default=1000, help="requests per alternation inside a round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--workers", type=int, default=1, help="uvicorn workers per server (default 1: one process each)"
    )
    parser.add_argument("--serve-gated", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-plain", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.serve_gated or args.serve_plain:
        if args.workers > 1:
            serve_workers(gated=args.serve_gated, workers=args.workers)
        else:
            serve(gated=args.serve_gated)
        return 0

    token = secrets.token_urlsafe(24)
    servers = {}
    try:
        servers["with"] = start_server(gated=True, workers=args.workers, token=token)
        servers["without"] = start_server(gated=False, workers=args.workers)
        requests_per_round, rounds, cpu = asyncio.run(measure(args, servers, token))
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    for name, cost in gate_cost_us().items():
        print(f"gate cost in-process, {name}: {cost:.2f} us/request")
    ratios = [wo / w for w, wo in zip(rounds["with"], rounds["without"], strict=True)]
    print(
        "per-round ratios (with/without): "
        + ", ".join(f"{r:.3f}" for r in ratios)
        + f" (median {statistics.median(ratios):.3f})"
    )
    # Every request counted once: total requests over total seconds, per variant.
    count = requests_per_round * args.rounds
    with_rps = count / sum(rounds["with"])
    without_rps = count / sum(rounds["without"])
    ratio = with_rps / without_rps
    print(
        f"all rounds, {args.workers} uvicorn worker(s) per server: with gate {with_rps:.0f} req/s, "
        f"without {without_rps:.0f} req/s, ratio {ratio:.3f} ({(1 - ratio) * 100:.1f}% slower with the gate; "
        f"target: under 5% slower, {'met' if ratio > 0.95 else 'NOT met'})"
    )
    cpu_us = {name: cpu[name] / count * 1e6 for name in cpu}
    print(
        f"server CPU per request (every process of the server): with gate {cpu_us['with']:.0f} us, "
        f"without {cpu_us['without']:.0f} us ({cpu_us['with'] - cpu_us['without']:+.0f} us)"
    )
    figures = {
        "with_plugin_rps": round(with_rps, 1),
        "without_plugin_rps": round(without_rps, 1),
        "workers": args.workers,
        "with_plugin_cpu_us": round(cpu_us["with"], 1),
        "without_plugin_cpu_us": round(cpu_us["without"], 1),
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
