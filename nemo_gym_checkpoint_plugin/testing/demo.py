"""``make demo``: Gym's rollout collection checkpointed on a real deployment, SIGKILLed, resumed, compared.

Run it as ``python -m nemo_gym_checkpoint_plugin.testing.demo`` (``--help`` for options);
it needs only the installed package and nemo-gym, not a source checkout.

Starts the project's deployment (the fake inference backend, ``vllm_model``,
``simple_agent``, ``example_single_tool_call`` and ``single_agent_turn`` from the
nemo-gym wheel, each wrapped as a checkpoint participant, all on 127.0.0.1, no Ray),
then runs ``collect_story.run_collect_story``: ``ng-checkpoint collect`` of ``--rollouts``
rows (64 by default) without interruption (the reference), the same rows again with a
checkpoint every ``--checkpoint-every`` seconds, SIGKILL of every server and of the
collector once a published checkpoint holds rows in flight, fresh servers,
``ng-checkpoint collect --resume`` to the end, and a row-by-row comparison of the two outputs.

Progress goes to stdout as ``[demo] ...`` lines; the last line is one JSON object::

    {"rollouts": N, "finished": N, "reward_1": N, "continued": K, "restarted": R,
     "lost": 0, "repeated_steps": 0, "checkpoint_dir": "...",
     "identical_to_uninterrupted": true, "prepare_s": p, "commit_s": c, "restore_s": r}

``continued``: rows in flight at the checkpoint that continued from it as their next attempt;
``restarted``: rows in flight at it that started over (restarts, rows it did not hold).
``repeated_steps`` is counted at the resources server (seeds) and at the inference backend
(completed calls per conversation): steps continued rows had completed before the checkpoint
that ran again. ``prepare_s`` and ``commit_s``: what the restored checkpoint cost the
deployment; ``restore_s``: the restore. Exit status 0 only when nothing was lost or repeated
and the output is identical to the uninterrupted one.

Ports: ``PORT_BASE`` when set (five consecutive ports from it; busy or invalid is exit 2
before anything starts), else free ports picked at random.

The work directory (server and collector logs, the checkpoints, both outputs): without ``--dir``
a new temporary one, removed at the end unless ``--keep`` or ``NG_DEMO_KEEP=1`` (a ``[demo]
removed ...`` line says so; ``checkpoint_dir`` in the summary then names where it was). A
``--dir`` is always kept, and so is the temporary one when the demo fails with an error (its
logs say why).

Ctrl-C (or SIGTERM) stops every server and collector and prints one line on stderr; exit status 130.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import orjson

from .collect_story import run_collect_story
from .crash_scenario import new_deployment
from .deployment import Deployment, DeploymentAborted, DeploymentError, parse_port_base, port_is_free
from .gym_config import PORT_OFFSETS

__all__ = ["main"]


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def _port_base() -> int | None:
    """``PORT_BASE`` checked and its ports free, or None when unset; ``ValueError`` saying what is wrong."""
    raw = os.environ.get("PORT_BASE")
    if not raw:
        return None
    base = parse_port_base(raw)
    taken = sorted(base + offset for offset in PORT_OFFSETS.values() if not port_is_free(base + offset))
    if taken:
        raise ValueError(f"PORT_BASE={base} is busy: 127.0.0.1 port(s) {taken} already in use")
    return base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_gym_checkpoint_plugin.testing.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rollouts", type=int, default=64, help="rows collected (default 64, at least 2)")
    parser.add_argument("--checkpoint-every", type=float, default=2.0, metavar="SECONDS",
                        help="seconds between checkpoints of the collection (default 2)")
    parser.add_argument("--dir", default=None, help="work directory, kept (default: a new temporary one)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary work directory (also NG_DEMO_KEEP=1)")
    args = parser.parse_args(argv)
    if args.rollouts < 2:
        parser.error("--rollouts must be at least 2")
    if not args.checkpoint_every > 0:
        parser.error("--checkpoint-every must be a positive number of seconds")
    try:
        port_base = _port_base()
    except ValueError as bad:
        print(f"demo: {bad}", file=sys.stderr)
        return 2
    keep = args.keep or args.dir is not None or os.environ.get("NG_DEMO_KEEP", "") not in ("", "0")
    work = Path(args.dir or tempfile.mkdtemp(prefix="ng-checkpoint-demo-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        summary = _run(work, args.rollouts, args.checkpoint_every, port_base)
    except DeploymentError as failed:
        print(f"demo: {failed}; work directory kept: {work}", file=sys.stderr, flush=True)
        return 1
    if summary is None:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
        where = f"work directory kept: {work}" if keep else f"removed {work}"
        print(f"[demo] interrupted: every server stopped; {where}", file=sys.stderr, flush=True)
        return 130
    ok = summary["lost"] == 0 and summary["repeated_steps"] == 0 and summary["identical_to_uninterrupted"]
    # A failed run keeps its work directory: the logs say why.
    if ok and not keep:
        shutil.rmtree(work, ignore_errors=True)
        _say(f"removed {work} (--keep or NG_DEMO_KEEP=1 keeps it)")
    print(orjson.dumps(summary).decode(), flush=True)
    return 0 if ok else 1


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _run(work: Path, rollouts: int, every: float, port_base: int | None) -> dict[str, Any] | None:
    """Start the deployment, run the scenario, stop every server; the summary, or None after Ctrl-C/SIGTERM.

    Ctrl-C never raises ``KeyboardInterrupt`` here: raised at an arbitrary point (while asyncio
    builds its loop, or a child is spawned) it leaves half-made objects and tracebacks behind.
    The signal only sets ``stop``; inside the loop it also cancels the scenario.
    """
    stop = threading.Event()

    def flag(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    for sig in _STOP_SIGNALS:
        signal.signal(sig, flag)
    token = secrets.token_urlsafe(24)
    deployment = new_deployment(work, token, port_base=port_base)
    try:
        # asyncio.run returns only once its worker threads are done (a start under way included).
        return asyncio.run(_scenario(deployment, work, token, rollouts, every, stop))
    finally:
        # Closing the loop reset the handlers; nothing may cut the stop short (servers have their own groups).
        for sig in _STOP_SIGNALS:
            signal.signal(sig, flag)
        deployment.stop()


async def _scenario(
    deployment: Deployment, work: Path, token: str, rollouts: int, every: float, stop: threading.Event,
) -> dict[str, Any] | None:
    task = asyncio.current_task()
    assert task is not None

    def interrupt() -> None:
        stop.set()
        task.cancel()

    loop = asyncio.get_running_loop()
    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, interrupt)
    if stop.is_set():  # a signal before the loop was ready
        return None
    try:
        _say(f"starting the Gym deployment (logs in {work / 'logs'})")
        started = time.monotonic()
        await asyncio.to_thread(deployment.start, abort=stop)
        ports = sorted(int(url.rsplit(":", 1)[1]) for url in deployment.urls.values())
        _say(f"5 processes ready in {time.monotonic() - started:.1f}s on 127.0.0.1:{ports[0]}-{ports[-1]}: "
             f"{', '.join(sorted(deployment.urls))}")
        return await run_collect_story(deployment, work, token, rollouts, every=every, say=_say)
    except (asyncio.CancelledError, DeploymentAborted):
        if stop.is_set():
            return None
        raise


if __name__ == "__main__":
    sys.exit(main())
