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

Checkpoints: under the work directory, or ``--checkpoint-dir`` (a directory, or an object-store URL
such as ``s3://bucket/demo``, reached through the store's standard environment: ``AWS_*`` for S3;
the servers then use ``checkpoint.storage.backend: fsspec``). ``--local-s3`` starts a real
S3-compatible server on 127.0.0.1 for the run (moto's server mode, from the ``test`` extras) and
checkpoints into it; it is stopped at the end.

``--num-workers N`` (or ``NUM_WORKERS=N``, as ``make demo NUM_WORKERS=N`` passes it) runs the model,
resources and environment servers with N uvicorn workers each (docs/protocol.md section 9a): the
same story, the same guarantees.

``--token-capture`` (or ``TOKEN_CAPTURE=1``, as ``make demo TOKEN_CAPTURE=1`` passes it) turns Gym's
training-token capture on for every agent (its local file store under the work directory) and adds
the capture invariant to the guarantees: after the resume, Gym's rebuild of every row's finished
attempt (``trajectories_for_rollout``, as a trainer reads it) is unmasked and holds one captured call
per model call of its turn. The summary then adds ``"capture": {"rows", "masked", "n_calls_wrong"}``
(the keys that fail), and the exit status is 0 only when both lists are empty.

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
import contextlib
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import orjson

from .._storage.objstore import is_url, normalize_url
from .collect_story import run_collect_story
from .crash_scenario import capture_dir, new_deployment
from .deployment import Deployment, DeploymentAborted, DeploymentError, parse_port_base, port_is_free
from .gym_config import PORT_OFFSETS
from .s3_server import LocalS3Server, S3ServerError

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
    parser.add_argument(
        "--checkpoint-every",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="seconds between checkpoints of the collection (default 2)",
    )
    parser.add_argument("--dir", default=None, help="work directory, kept (default: a new temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary work directory (also NG_DEMO_KEEP=1)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--checkpoint-dir",
        metavar="DIR_OR_URL",
        help="where the checkpoints go: an absolute directory or an object-store URL (s3://bucket/"
        "prefix; credentials from the store's own environment); default: the work directory",
    )
    where.add_argument(
        "--local-s3",
        action="store_true",
        help="start a local S3-compatible server (moto, 127.0.0.1) and checkpoint into it",
    )
    parser.add_argument(
        "--num-workers",
        type=int,
        default=int(os.environ.get("NUM_WORKERS") or 1),
        metavar="N",
        help="uvicorn workers of the model, resources and environment servers (default 1, or NUM_WORKERS)",
    )
    parser.add_argument(
        "--token-capture",
        action="store_true",
        default=os.environ.get("TOKEN_CAPTURE", "") not in ("", "0"),
        help="Gym's token capture on, and the capture invariant checked (also TOKEN_CAPTURE=1)",
    )
    args = parser.parse_args(argv)
    if args.num_workers < 1:
        parser.error("--num-workers must be at least 1")
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
        with _checkpoint_store(args, work) as (checkpoint_root, store_env):
            summary = _run(
                work,
                args.rollouts,
                args.checkpoint_every,
                port_base,
                checkpoint_root,
                store_env,
                args.num_workers,
                args.token_capture,
            )
    except (DeploymentError, S3ServerError) as failed:
        print(f"demo: {failed}; work directory kept: {work}", file=sys.stderr, flush=True)
        return 1
    except ValueError as bad:
        print(f"demo: --checkpoint-dir: {bad}", file=sys.stderr)
        return 2
    if summary is None:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
        left = f"work directory kept: {work}" if keep else f"removed {work}"
        print(f"[demo] interrupted: every server stopped; {left}", file=sys.stderr, flush=True)
        return 130
    capture = summary.get("capture") or {}
    ok = (
        summary["lost"] == 0
        and summary["repeated_steps"] == 0
        and summary["identical_to_uninterrupted"]
        and not capture.get("masked")
        and not capture.get("n_calls_wrong")
    )
    # A failed run keeps its work directory: the logs say why.
    if ok and not keep:
        shutil.rmtree(work, ignore_errors=True)
        _say(f"removed {work} (--keep or NG_DEMO_KEEP=1 keeps it)")
    print(orjson.dumps(summary).decode(), flush=True)
    return 0 if ok else 1


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _checkpoint_store(args: argparse.Namespace, work: Path) -> Iterator[tuple[str | None, dict[str, str]]]:
    """``(checkpoint root or None for the work directory, environment the servers need to reach it)``."""
    if args.local_s3:
        (work / "logs").mkdir(parents=True, exist_ok=True)
        with LocalS3Server(log=work / "logs" / "s3-server.log") as server:
            root = server.url(f"demo-{secrets.token_hex(4)}")
            _say(f"started a local S3 server on {server.endpoint} (moto); checkpoints go to {root}")
            saved = server.apply()  # the collectors this process starts reach it the same way
            try:
                yield root, server.env
            finally:
                LocalS3Server.restore(saved)
        return
    if args.checkpoint_dir is None:
        yield None, {}
        return
    if is_url(args.checkpoint_dir):
        yield normalize_url(args.checkpoint_dir), {}
        return
    if not os.path.isabs(args.checkpoint_dir):
        raise ValueError(f"{args.checkpoint_dir} is relative; give an absolute directory or a URL")
    yield args.checkpoint_dir, {}


def _run(
    work: Path,
    rollouts: int,
    every: float,
    port_base: int | None,
    checkpoint_root: str | None = None,
    store_env: dict[str, str] | None = None,
    num_workers: int = 1,
    token_capture: bool = False,
) -> dict[str, Any] | None:
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
    storage = {"backend": "fsspec"} if checkpoint_root is not None and is_url(checkpoint_root) else None
    deployment = new_deployment(
        work,
        token,
        port_base=port_base,
        storage=storage,
        extra_env=store_env,
        num_workers=num_workers,
        token_capture=token_capture,
    )
    captures = capture_dir(work) if token_capture else None
    try:
        # asyncio.run returns only once its worker threads are done (a start under way included).
        return asyncio.run(_scenario(deployment, work, token, rollouts, every, stop, checkpoint_root, captures))
    finally:
        # Closing the loop reset the handlers; nothing may cut the stop short (servers have their own groups).
        for sig in _STOP_SIGNALS:
            signal.signal(sig, flag)
        deployment.stop()


async def _scenario(
    deployment: Deployment,
    work: Path,
    token: str,
    rollouts: int,
    every: float,
    stop: threading.Event,
    checkpoint_root: str | None = None,
    captures: Path | None = None,
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
        await asyncio.to_thread(deployment.start, None, stop)
        ports = sorted(int(url.rsplit(":", 1)[1]) for url in deployment.urls.values())
        _say(
            f"5 processes ready in {time.monotonic() - started:.1f}s on 127.0.0.1:{ports[0]}-{ports[-1]}: "
            f"{', '.join(sorted(deployment.urls))}"
        )
        return await run_collect_story(
            deployment, work, token, rollouts, every=every, say=_say, checkpoint_root=checkpoint_root, captures=captures
        )
    except (asyncio.CancelledError, DeploymentAborted):
        if stop.is_set():
            return None
        raise


if __name__ == "__main__":
    sys.exit(main())
