"""The CLI commands that talk to a running deployment: ``status`` and driving a checkpoint by hand.

Each command discovers the deployment (from ``--config`` or ``--url``), runs one
coordination operation with a progress line per participant reply on stderr, and
prints a summary (or ``--json``). Exit status: 0 done, 1 a server failed (every
failing server is named with its code), 3 ``prepare`` not ready by its deadline.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..coordination import CoordinationError, Coordinator, discover, load_config, token_from_config
from ..settings import SettingsError
from .output import ProgressPrinter, print_json, table

__all__ = ["run_live", "UsageError"]

NOT_READY = 3


class UsageError(Exception):
    """Bad command-line input the parser cannot see (a missing token, an empty scope)."""


def resolve_token(args: argparse.Namespace) -> str:
    """``--token-env`` first, else the config's ``checkpoint:`` block. Never printed anywhere."""
    if args.token_env:
        token = os.environ.get(args.token_env, "")
        if not token:
            raise UsageError(f"--token-env names {args.token_env!r}, which is unset or empty")
        return token
    if args.config:
        try:
            token = token_from_config(load_config(args.config))
        except SettingsError as exc:
            raise UsageError(str(exc)) from None
        if token:
            return token
    raise UsageError("no control token: pass --token-env VAR, or --config with a checkpoint: block naming one")


def read_episodes(args: argparse.Namespace) -> list[str]:
    """Capture keys from ``--episode`` and ``--episodes-file`` (one key per line, ``#`` comments)."""
    keys = list(args.episode or ())
    if getattr(args, "episodes_file", None):
        for line in Path(args.episodes_file).read_text(encoding="utf-8").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                keys.append(line)
    return keys


async def _discover(args: argparse.Namespace, *, strict: bool) -> Coordinator:
    source: Any = args.url if args.url else args.config
    if source is None:
        raise UsageError("say where the deployment is: --config GYM_YAML or --url URL (repeatable)")
    return await discover(
        source, resolve_token(args), probe_timeout=args.probe_timeout, tries=args.tries, strict=strict
    )


def _lease(value: Any) -> str | None:
    if not isinstance(value, int | float):
        return None
    return f"{value - time.time():+.0f}s"


async def _status(args: argparse.Namespace) -> int:
    async with await _discover(args, strict=False) as coordinator:
        statuses, failures = await coordinator.status(timeout=args.probe_timeout * args.tries)
        failures = coordinator.failures + failures
        if args.json:
            print_json({
                "participants": [{"name": p.name, "url": p.url, **statuses.get(p.name, {})}
                                 for p in coordinator.participants if p.name in statuses],
                "non_participants": [{"name": e.name, "url": e.url} for e in coordinator.non_participants],
                "failures": [f.to_json() for f in failures],
            })
            return 1 if failures else 0
        rows = []
        for participant in coordinator.participants:
            status = statuses.get(participant.name)
            if status is None:
                continue
            report = status.get("report") or {}
            counts = ",".join(f"{k}={v}" for k, v in sorted((report.get("counts") or {}).items()))
            rows.append([
                participant.name, status.get("kind"), status.get("instance"), status.get("phase"),
                status.get("checkpoint_id"), _lease(status.get("lease_expires_at")), status.get("retired_rollouts"),
                report.get("blocker_count"), len(report.get("restarts") or ()), counts or None, participant.url,
            ])
        for endpoint in coordinator.non_participants:
            rows.append([endpoint.name, None, None, "not a participant", None, None, None, None, None, None,
                         endpoint.url])
        for failure in failures:
            rows.append([failure.server, None, None, f"ERROR {failure.code}", None, None, None, None, None, None,
                         failure.url or None])
        print(table(["NAME", "KIND", "INSTANCE", "PHASE", "CHECKPOINT", "LEASE", "RETIRED", "BLOCKERS",
                     "RESTARTS", "COUNTS", "URL"], rows))
        for failure in failures:
            print(f"error: {failure.describe()}", file=sys.stderr)
        return 1 if failures else 0


def _summary(args: argparse.Namespace, payload: dict[str, Any], text: str) -> None:
    if args.json:
        print_json(payload)
    else:
        print(text)


def _check_scope(args: argparse.Namespace) -> None:
    """Refuse an empty scope before touching the deployment."""
    if args.command == "commit" and not args.all and not read_episodes(args):
        raise UsageError("commit needs its scope: --episode KEY (repeatable), --episodes-file, or --all")
    if args.command in ("restore", "retire") and not read_episodes(args):
        raise UsageError(f"{args.command} needs --episode KEY (repeatable) or --episodes-file")


async def _operate(args: argparse.Namespace) -> int:
    _check_scope(args)
    deadline_ts = time.time() + args.deadline
    command = args.command
    async with await _discover(args, strict=True) as coordinator:
        if not args.json:
            coordinator.progress = ProgressPrinter()
            print(f"{command} {args.checkpoint_id} on {len(coordinator.participants)} participant(s), "
                  f"deadline in {args.deadline:g}s", file=sys.stderr)
        if command == "prepare":
            result = await coordinator.prepare(args.checkpoint_id, deadline_ts=deadline_ts)
            text = (f"prepared {args.checkpoint_id}: ready" if result.ready else
                    f"prepare {args.checkpoint_id} NOT ready: stopped at {result.stopped_at}, "
                    f"{result.blocker_count()} blocker(s) {result.blockers()[:10]}; "
                    f"not reached: {result.not_reached}; resume it with `ng-checkpoint resume {args.checkpoint_id}`")
            if result.restarts():
                text += f"\nrestarts (leave them out of the commit scope): {result.restarts()}"
            _summary(args, result.to_json(), text)
            return 0 if result.ready else NOT_READY
        if command == "commit":
            scope = None if args.all else read_episodes(args)
            result = await coordinator.commit(args.checkpoint_id, str(Path(args.dir).resolve()), scope,
                                              stop=args.stop, deadline_ts=deadline_ts)
            counts = {name: len(keys) for name, keys in result.episode_ids.items()}
            _summary(args, result.to_json(), f"committed {args.checkpoint_id} to {args.dir}: {counts}")
            return 0
        if command == "restore":
            episodes = read_episodes(args)
            result = await coordinator.restore(args.checkpoint_id, str(Path(args.dir).resolve()), episodes,
                                               deadline_ts=deadline_ts)
            _summary(args, result.to_json(),
                     f"restored {result.source_checkpoint_id} as {args.checkpoint_id}: {result.restored()}; "
                     f"run `ng-checkpoint resume {args.checkpoint_id}` to continue them")
            return 0
        if command == "retire":
            episodes = read_episodes(args)
            replies = await coordinator.retire(args.checkpoint_id, episodes, deadline_ts=deadline_ts)
            _summary(args, replies, f"retired {len(episodes)} episode(s) on {len(replies)} participant(s)")
            return 0
        if command == "forget":
            replies = await coordinator.forget(args.checkpoint_id, args.rollout, deadline_ts=deadline_ts)
            _summary(args, replies, f"forgot {len(args.rollout)} rollout(s) on {len(replies)} participant(s)")
            return 0
        if command == "renew":
            leases = await coordinator.renew(args.checkpoint_id, deadline_ts=deadline_ts)
            _summary(args, leases, "renewed: " + ", ".join(f"{n} {_lease(v)}" for n, v in leases.items()))
            return 0
        replies = await coordinator.resume(args.checkpoint_id, deadline_ts=deadline_ts)
        _summary(args, replies, f"resumed {args.checkpoint_id} on {len(replies)} participant(s)")
        return 0


async def run_live(args: argparse.Namespace) -> int:
    """Run ``status`` or a driving command; report a ``CoordinationError`` server by server."""
    try:
        if args.command == "status":
            return await _status(args)
        return await _operate(args)
    except CoordinationError as exc:
        if args.json:
            print_json({"error": exc.to_json()})
        print(f"error: {exc}", file=sys.stderr)
        return 1
