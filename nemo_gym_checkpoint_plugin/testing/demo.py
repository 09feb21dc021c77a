"""``make demo``: checkpoint a real Gym deployment with rollouts in flight, SIGKILL it, restore, finish.

Run it as ``python -m nemo_gym_checkpoint_plugin.testing.demo`` (``--help`` for options);
it needs only the installed package and nemo-gym, not a source checkout.

Starts the project's deployment (the fake inference backend, ``vllm_model``,
``simple_agent``, ``example_single_tool_call`` and ``single_agent_turn`` from the
nemo-gym wheel, each wrapped as a checkpoint participant, all on 127.0.0.1, no Ray),
then runs ``crash_scenario.run_scenario``: rollouts in flight with their model calls
held, a staged prepare, a commit, SIGKILL of every process group, fresh processes, a
restore and resume, the restarts retired, and ``/run`` of every rollout as its next
attempt. A quarter of the rollouts (at least one) declare themselves not capturable, so
they are restarts and start over.

Progress goes to stdout as ``[demo] ...`` lines; the last line is one JSON object::

    {"rollouts": N, "finished": N, "reward_1": N, "continued": K, "restarted": R,
     "lost": 0, "repeated_steps": 0, "checkpoint_dir": "..."}

``repeated_steps`` is counted at the resources server (seeds) and at the inference
backend (completed calls per conversation step): steps of continued rollouts that ran
again after the crash. Exit status 0 only when nothing was lost or repeated.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import tempfile
import time
from pathlib import Path

import orjson

from .crash_scenario import new_deployment, run_scenario

__all__ = ["main"]


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_gym_checkpoint_plugin.testing.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rollouts", type=int, default=12, help="rollouts in flight at the checkpoint (>= 2)")
    parser.add_argument("--dir", default=None, help="work directory (default: a new temporary one)")
    args = parser.parse_args(argv)
    if args.rollouts < 2:
        parser.error("--rollouts must be at least 2 (one continued, one restarted)")
    work = Path(args.dir or tempfile.mkdtemp(prefix="ng-checkpoint-demo-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    restarts = max(1, args.rollouts // 4)
    continued = [f"cont-{i:03d}" for i in range(args.rollouts - restarts)]
    restarted = [f"rest-{i:03d}" for i in range(restarts)]
    token = secrets.token_urlsafe(24)

    deployment = new_deployment(work, token)
    _say(f"starting the Gym deployment (logs in {work / 'logs'})")
    started = time.monotonic()
    deployment.start()
    _say(f"5 processes ready in {time.monotonic() - started:.1f}s: {', '.join(sorted(deployment.urls))}")
    try:
        result = asyncio.run(run_scenario(deployment, work / "ckpt", token, continued, restarted, say=_say))
    finally:
        deployment.stop()
    summary = result.summary()
    print(orjson.dumps(summary).decode(), flush=True)
    return 0 if summary["lost"] == 0 and summary["repeated_steps"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
