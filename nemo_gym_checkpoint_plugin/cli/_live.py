"""The CLI commands that talk to a running deployment: ``status`` and driving a checkpoint by hand.

Each command finds the deployment and token (``where``), checks its scope before any
server is called (``scope``), runs one coordination operation with its progress on
stderr (``progress``), and prints a summary in words (or ``--json``). Every command it
suggests (resume after a failure, and so on) is printed with the options that name the
same deployment, so it works when pasted. Exit status: 0 done, 1 a server failed (every
failing server is named with its code, once), 3 ``prepare`` not ready by its deadline.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Any

from ..coordination import CoordinationError, Coordinator, discover
from ..coordination._ownership import OWNER_CONFLICT
from ._failures import explain, explain_error
from ._output import print_error, print_json, words
from ._progress import ProgressDisplay, showing_progress
from ._scope import commit_all_scope, dir_argument, read_episodes, restore_scope
from ._status import lease, run_status
from ._where import Deployment, UsageError, resolve_deployment, suggest

__all__ = ["run_live", "UsageError"]

NOT_READY = 3
RETRY_SUFFIX = "-retry"


def _check_scope(args: argparse.Namespace) -> list[str] | None:
    """The scope of ``commit``/``retire`` (``restore``'s is checked against its checkpoint), before any call."""
    if args.command == "commit":
        given = read_episodes(args)
        if args.all and given:
            raise UsageError("commit takes --all or --episode/--episodes-file, not both")
        if not args.all and not given:
            raise UsageError("commit needs its scope: --episode KEY (repeatable), --episodes-file, or --all")
        return None if args.all else given
    if args.command == "retire":
        given = read_episodes(args)
        if not given:
            raise UsageError("retire needs --episode KEY (repeatable) or --episodes-file")
        return given
    if args.command == "restore":
        return restore_scope(args)
    return None


# What a controller must do with the restored rollouts once resumed (docs/trainer.md, rule 2).
_RESEND = (
    "then send each restored rollout's row again as the attempt named above, its attempt N+1 (r1-a1: "
    '_ng_rollout_id "r1-a1" with the row\'s task fields, or {"rollout_id": "r1", "attempt": 1}), '
    "never as attempt N (refused stale_attempt); see docs/trainer.md"
)


async def _discover(args: argparse.Namespace, deployment: Deployment) -> Coordinator:
    """Probe the deployment; any server failing is one ``CoordinationError`` (a refused token folded)."""
    coordinator = await discover(
        deployment.source, deployment.token, probe_timeout=args.probe_timeout, tries=args.tries, strict=False
    )
    if coordinator.failures:
        await coordinator.close()
        servers = (
            len(coordinator.participants)
            + len(coordinator.non_participants)
            + len({f.server for f in coordinator.failures if f.url})
        )
        raise CoordinationError("discover", coordinator.failures, result={"servers": servers})
    return coordinator


def _commit_scope_argv(args: argparse.Namespace) -> list[str]:
    if args.all:
        return ["--all"]
    argv = [part for key in args.episode or () for part in ("--episode", key)]
    return argv + (["--episodes-file", args.episodes_file] if args.episodes_file else [])


def _what_next(args: argparse.Namespace, deployment: Deployment) -> str | None:
    """What to do after a failed operation, in words, with the commands to paste."""
    resume = suggest("resume", deployment, args.checkpoint_id)
    if args.command == "commit":
        retry = f"{args.checkpoint_id}{RETRY_SUFFIX}"
        new_dir = f"{args.dir.rstrip('/')}{RETRY_SUFFIX}"
        return (
            f"what to do next: checkpoint {args.checkpoint_id} was not written everywhere, so {args.dir} is "
            "incomplete: do not restore from it. The participants still hold admission closed. Resume "
            f"{args.checkpoint_id} to reopen it, then prepare again under a new id (an id is used once) and "
            "commit into a new directory:\n"
            f"  {resume}\n"
            f"  {suggest('prepare', deployment, retry)}\n"
            f"  {suggest('commit', deployment, retry, '--dir', new_dir, *_commit_scope_argv(args))}"
        )
    if args.command == "prepare":
        return f"what to do next: participants that prepared keep admission closed until resumed:\n  {resume}"
    return None


def _occupied(args: argparse.Namespace, deployment: Deployment) -> str:
    """A commit refused before anything was written: the directory holds another checkpoint, kept intact."""
    new_dir = f"{args.dir.rstrip('/')}{RETRY_SUFFIX}"
    return (
        f"what to do next: nothing was written and {args.dir}'s checkpoint is untouched (ng-checkpoint "
        f"verify {args.dir} checks it). Commit {args.checkpoint_id} into a new directory (the participants "
        f"still hold admission closed until then, or resume):\n"
        f"  {suggest('commit', deployment, args.checkpoint_id, '--dir', new_dir, *_commit_scope_argv(args))}\n"
        f"  {suggest('resume', deployment, args.checkpoint_id)}"
    )


def _owned_elsewhere(exc: CoordinationError, args: argparse.Namespace, deployment: Deployment) -> str | None:
    """Who owns the deployment and how to take it over, when the command was refused for that."""
    refused = [f for f in exc.failures if f.code == OWNER_CONFLICT]
    if not refused:
        return None
    holder = re.search(r"owned by (\S+) until ([0-9-]+ [0-9:]+)", refused[0].detail)
    who = f"{holder[1]}, until {holder[2]}" if holder else refused[0].detail
    text = (
        f"the deployment is owned by another controller ({who}); {args.command} was refused on "
        f"{len(refused)} server(s) and changed nothing there."
    )
    if args.command in ("prepare", "restore"):
        argv = [args.checkpoint_id, *(["--dir", args.dir] if args.command == "restore" else [])]
        return (
            f"{text} To take it over (the owner is fenced for good: only do this when it is gone or must "
            f"stop):\n  {suggest(args.command, deployment, *argv, '--take-over')}"
        )
    return f"{text} Wait for it to end, or take it over with prepare --take-over or restore --take-over."


async def _operate(
    args: argparse.Namespace, deployment: Deployment, coordinator: Coordinator, scope: list[str] | None
) -> int:
    """Run the operation with its progress shown, then print the summary (after the live line is gone)."""
    command, checkpoint_id = args.command, args.checkpoint_id
    deadline_ts = time.time() + args.deadline
    display = None
    if not args.json:
        display = ProgressDisplay(command, checkpoint_id, coordinator, deadline_ts, every=args.progress_every)
        print(
            f"{command} {checkpoint_id} on {len(coordinator.participants)} participant(s), "
            f"deadline in {args.deadline:g}s",
            file=sys.stderr,
        )
    async with showing_progress(display, coordinator):
        code, payload, text = await _call(args, deployment, coordinator, scope, deadline_ts)
    if args.json:
        print_json(payload)
    else:
        print(text)
    return code


async def _call(
    args: argparse.Namespace,
    deployment: Deployment,
    coordinator: Coordinator,
    scope: list[str] | None,
    deadline_ts: float,
) -> tuple[int, Any, str]:
    """The operation itself: (exit status, the JSON document, the summary in words)."""
    command, checkpoint_id = args.command, args.checkpoint_id
    coordinator.owner = deployment.owner  # every call names this CLI's owner id (one controller per deployment)
    if command == "prepare":
        prepared = await coordinator.prepare(checkpoint_id, deadline_ts=deadline_ts, take_over=args.take_over)
        if prepared.ready:
            text = f"prepared {checkpoint_id}: ready"
        else:
            text = (
                f"prepare {checkpoint_id} NOT ready: stopped at {words(prepared.stopped_at or [])}, "
                f"{prepared.blocker_count()} blocker(s): {words(prepared.blockers())}; not reached: "
                f"{words(prepared.not_reached)}"
                + (f"; workers: {words(prepared.worker_blockers())}" if prepared.worker_blockers() else "")
                + ". Admission stays closed until you resume:\n"
                f"  {suggest('resume', deployment, checkpoint_id)}"
            )
        if prepared.restarts():
            text += f"\nrestarts (leave them out of the commit scope): {words(prepared.restarts(), limit=50)}"
        return (0 if prepared.ready else NOT_READY), prepared.to_json(), text
    if command == "commit":
        left_out: list[str] = []
        if args.all:
            scope, left_out = await _commit_all_scope(args, coordinator)
        committed = await coordinator.commit(
            checkpoint_id, dir_argument(args.dir), scope, stop=args.stop, deadline_ts=deadline_ts
        )
        counts = ", ".join(f"{name} {len(keys)}" for name, keys in sorted(committed.episode_ids.items()))
        text = f"committed {checkpoint_id} to {args.dir}: episodes written: {counts}"
        if left_out:
            text += (
                f"\nleft out {len(left_out)} restart(s) (they start over after a crash): {words(left_out, limit=50)}"
            )
        return 0, {**committed.to_json(), "restarts_left_out": left_out}, text
    if command == "restore":
        # Each key is the replacement attempt a rollout continues as (``r1-a1``): N+1 of the attempt that crashed.
        restored = await coordinator.restore(
            checkpoint_id, dir_argument(args.dir), scope or [], deadline_ts=deadline_ts, take_over=args.take_over
        )
        return (
            0,
            restored.to_json(),
            (
                f"restored {restored.source_checkpoint_id} as {checkpoint_id}: "
                f"{words(restored.restored(), limit=20)}; to continue them, resume:\n"
                f"  {suggest('resume', deployment, checkpoint_id)}\n" + _RESEND
            ),
        )
    if command == "retire":
        replies = await coordinator.retire(checkpoint_id, scope or [], deadline_ts=deadline_ts)
        return 0, replies, f"retired {len(scope or [])} episode(s) on {len(replies)} participant(s)"
    if command == "forget":
        replies = await coordinator.forget(checkpoint_id, args.rollout, deadline_ts=deadline_ts)
        return 0, replies, f"forgot {len(args.rollout)} rollout(s) on {len(replies)} participant(s)"
    if command == "renew":
        leases = await coordinator.renew(checkpoint_id, deadline_ts=deadline_ts)
        return 0, leases, "renewed: " + ", ".join(f"{n} {lease(v)}" for n, v in leases.items())
    replies = await coordinator.resume(checkpoint_id, deadline_ts=deadline_ts)
    # This CLI's checkpoint (or restore) is over: the deployment is no longer its to hold.
    try:
        await coordinator.release(timeout=max(deadline_ts - time.time(), 1.0))
    except CoordinationError as exc:
        print(f"warning: releasing the deployment failed: {str(exc).splitlines()[0]}", file=sys.stderr)
    return 0, replies, f"resumed {checkpoint_id} on {len(replies)} participant(s)"


async def _commit_all_scope(args: argparse.Namespace, coordinator: Coordinator) -> tuple[list[str] | None, list[str]]:
    """``--all``: everything held minus every restart any participant reported (read from their status)."""
    statuses, failed = await coordinator.status(timeout=args.probe_timeout * args.tries)
    if failed:
        raise CoordinationError("status", failed)
    return commit_all_scope(statuses)


async def run_live(args: argparse.Namespace) -> int:
    """Run ``status`` or a driving command; report a ``CoordinationError`` once, server by server."""
    deployment = None
    coordinator = None
    try:
        deployment = resolve_deployment(args)
        if args.command == "status":
            return await run_status(args, deployment)
        scope = _check_scope(args)
        coordinator = await _discover(args, deployment)
        async with coordinator:
            return await _operate(args, deployment, coordinator, scope)
    except CoordinationError as exc:
        servers = len(coordinator.participants) if coordinator is not None else None
        if exc.operation == "discover" and isinstance(exc.result, dict):
            servers = exc.result.get("servers")
        message = explain_error(exc, deployment, servers)
        advice = _owned_elsewhere(exc, args, deployment) if deployment else None
        if (
            advice is None
            and args.command == "commit"
            and isinstance(exc.result, dict)
            and exc.result.get("other_checkpoints")
            and deployment
        ):
            advice = _occupied(args, deployment)
        if advice is None and exc.operation == args.command and deployment:
            advice = _what_next(args, deployment)
        if args.json:
            lines, shown = explain(exc.failures, deployment, servers)
            print_error(
                args.command,
                message,
                as_json=True,
                code="coordination_failed",
                **{**exc.to_json(), "failures": [f.to_json() for f in shown]},
                messages=lines,
                what_next=advice,
            )
        else:
            print(f"error: {message}", file=sys.stderr)
            if advice:
                print(advice, file=sys.stderr)
        return 1
