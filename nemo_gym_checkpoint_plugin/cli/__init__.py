"""``ng-checkpoint``: operate checkpoints of a NeMo Gym deployment from a shell.

Commands that talk to a deployment (``status``, ``prepare``, ``commit``, ``resume``,
``restore``, ``retire``, ``forget``, ``renew``) find it from ``--config`` (the Gym YAML:
top-level server blocks with host/port) or ``--url`` (repeatable), with the control
token from ``--token-env VAR`` or the config's ``checkpoint:`` block; the token is never
printed. ``inspect DIR`` and ``verify DIR`` read a checkpoint directory offline.
Every command has ``--help`` and ``--json``.

Exit status: 0 success; 1 a server failed or a checkpoint does not verify; 2 bad usage;
3 ``prepare`` not ready by its deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from ..coordination import DEFAULT_TIMEOUT
from .live import UsageError, run_live
from .offline import inspect_checkpoint, verify_checkpoint
from .output import print_json, table

__all__ = ["build_parser", "main"]

USAGE_ERROR = 2


def _positive(value: str) -> float:
    number = float(value)
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is not a positive number of seconds")
    return number


def _common(json_only: bool = False) -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--json", action="store_true", help="print one JSON document on stdout (for scripts)")
    if json_only:
        return parent
    where = parent.add_argument_group("deployment")
    where.add_argument("--config", metavar="GYM_YAML", help="the Gym config: top-level server blocks with host/port")
    where.add_argument("--url", action="append", metavar="URL",
                       help="a server's base URL, e.g. http://127.0.0.1:8001 (repeatable; instead of --config)")
    where.add_argument("--token-env", metavar="VAR",
                       help="environment variable holding the control token (default: the config's "
                            "checkpoint.control_auth_token_env)")
    where.add_argument("--probe-timeout", type=_positive, default=2.0, metavar="S",
                       help="seconds to wait for each status probe (default 2)")
    where.add_argument("--tries", type=int, default=3, metavar="N", help="status probes per server (default 3)")
    return parent


def _operation(sub: argparse._SubParsersAction, name: str, help_text: str, parents: list) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_text, description=help_text, parents=parents)
    parser.add_argument("checkpoint_id", help="the operation's checkpoint id")
    parser.add_argument("--deadline", type=_positive, default=DEFAULT_TIMEOUT, metavar="S",
                        help=f"seconds from now the participants have to finish (default {DEFAULT_TIMEOUT:g})")
    return parser


def _scope_args(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--episode", action="append", metavar="KEY",
                        help=f"{what}: a capture key (r or r-aN), repeatable")
    parser.add_argument("--episodes-file", metavar="FILE", help="capture keys, one per line")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ng-checkpoint",
        description="Checkpoint a running NeMo Gym deployment, drive it by hand, and check checkpoints offline.",
        epilog="exit status: 0 ok, 1 a server failed or a checkpoint does not verify, 2 usage, 3 prepare not ready",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    live = [_common()]
    sub.add_parser("status", parents=live, help="every participant's kind, phase, checkpoint, lease and counts",
                   description="Probe every server and show each participant's kind, phase, checkpoint id, "
                               "lease, retired rollouts, blockers, restarts and counts.")
    _operation(sub, "prepare", "close admission stage by stage and wait for readiness", live)
    commit = _operation(sub, "commit", "write every participant's state into a checkpoint directory", live)
    commit.add_argument("--dir", required=True, help="the checkpoint directory (shared by every participant)")
    _scope_args(commit, "the commit scope")
    commit.add_argument("--all", action="store_true", help="scope: everything each participant holds")
    commit.add_argument("--stop", action="store_true", help="the controller stops after this checkpoint")
    _operation(sub, "resume", "reopen admission everywhere (reverse order), past failures", live)
    restore = _operation(sub, "restore", "restore a checkpoint everywhere, all or nothing", live)
    restore.add_argument("--dir", required=True, help="the checkpoint directory to restore from")
    _scope_args(restore, "a checkpointed attempt to restore")
    retire = _operation(sub, "retire", "retire episode attempts everywhere", live)
    _scope_args(retire, "an attempt to retire")
    forget = _operation(sub, "forget", "remove retired marks of rollouts everywhere", live)
    forget.add_argument("--rollout", action="append", required=True, metavar="ID", help="a rollout id, repeatable")
    _operation(sub, "renew", "extend every participant's lease", live)

    offline = [_common(json_only=True)]
    inspect = sub.add_parser("inspect", parents=offline, help="list a checkpoint directory's participants",
                             description="Show each participant of a checkpoint directory: kind, instance, "
                                         "checkpoint id, record count, records size and digest (no server needed).")
    inspect.add_argument("dir", help="the checkpoint directory")
    inspect.add_argument("--episodes", action="store_true", help="also list every record's capture key")
    verify = sub.add_parser("verify", parents=offline, help="check every manifest and digest offline",
                            description="Verify every participant of a checkpoint directory: manifest fields, "
                                        "records file inside the participant directory, digest, count, records. "
                                        "Exit 0 only when all verify.")
    verify.add_argument("dir", help="the checkpoint directory")
    return parser


def _inspect(args: argparse.Namespace) -> int:
    checks = inspect_checkpoint(Path(args.dir), episodes=args.episodes)
    if args.json:
        print_json({"dir": args.dir, "participants": [c.to_json() for c in checks]})
    else:
        rows = [[c.kind, c.instance, c.manifest.get("checkpoint_id"), c.manifest.get("record_count"),
                 c.records_bytes, (c.manifest.get("records_sha256") or "")[:12] or None,
                 "ok" if c.ok else f"BAD: {c.problem}"] for c in checks]
        print(table(["KIND", "INSTANCE", "CHECKPOINT", "RECORDS", "BYTES", "SHA256", "STATE"], rows))
        for check in checks:
            if check.episodes is not None:
                print(f"{check.name}: {' '.join(check.episodes) or '(no records)'}")
    return 0 if all(c.ok for c in checks) else 1


def _verify(args: argparse.Namespace) -> int:
    warnings: list[str] = []
    checks = verify_checkpoint(Path(args.dir), warnings)
    ok = bool(checks) and all(c.ok for c in checks)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        print_json({"dir": args.dir, "ok": ok, "participants": [c.to_json() for c in checks], "warnings": warnings})
    else:
        for check in checks:
            if check.ok:
                manifest = check.manifest
                print(f"ok    {check.name}  {manifest['checkpoint_id']}  {manifest['record_count']} records")
            else:
                print(f"FAIL  {check.name}: {check.problem}")
    if not checks:
        print(f"error: {args.dir} holds no participant directories under gym/", file=sys.stderr)
    elif not ok:
        bad = [c.name for c in checks if not c.ok]
        print(f"error: {len(bad)} of {len(checks)} participant(s) do not verify: {', '.join(bad)}", file=sys.stderr)
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ng-checkpoint``; returns the exit status (``sys.exit`` it)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "verify":
            return _verify(args)
        return asyncio.run(run_live(args))
    except UsageError as exc:
        print(f"ng-checkpoint {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except FileNotFoundError as exc:
        print(f"ng-checkpoint {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
