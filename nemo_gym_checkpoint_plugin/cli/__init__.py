"""``ng-checkpoint``: operate checkpoints of a NeMo Gym deployment from a shell.

Commands that talk to a deployment (``status``, ``prepare``, ``commit``, ``resume``,
``restore``, ``retire``, ``forget``, ``renew``) find it from ``--config`` (the Gym YAML:
top-level server blocks with host/port), ``--url`` (repeatable), or else the Gym config
``NG_CHECKPOINT_CONFIG`` names. The control token comes from ``--token-file`` or
``--token-env`` (explicit), else the config's ``checkpoint.control_auth_token_env``, else
``NG_CHECKPOINT_TOKEN``; it is never printed (see ``where``). ``inspect DIR`` and
``verify DIR`` read a checkpoint directory offline (a path or an object-store URL); ``gc DIR
--keep K`` removes old checkpoints of a directory (a dry run unless ``--yes``); ``enable GYM_YAML``
prepares a Gym config and its server venvs for Gym's own launcher (``_enable.py``). Every command has ``--help`` and
``--json`` (before or after the command; errors are JSON documents too); ``--version``.

Exit status: 0 success; 1 a server failed or a checkpoint does not verify; 2 bad usage;
3 ``prepare`` not ready by its deadline.

Libraries: the parser stays the standard library's ``argparse``: it already gave every
command, option, help text and exit status (usage errors exit 2) that scripts rely on, so
keeping it changes none of them. Terminal output uses ``rich`` (already installed with
NeMo Gym, widely used and maintained): tables sized to the terminal (80 columns when not
one) that wrap long cells, and a live progress line on a terminal's stderr. ``click``
would have given shell completion for free, but at the price of re-declaring every
command and changing its help and usage texts; argparse gives no completion, so there is none.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from .._errors import InvalidCheckpointState
from .._storage.location import Location, is_dir, location
from .._storage.objstore import is_url
from .._wire import OWNER_PATTERN
from ..coordination import DEFAULT_TIMEOUT
from ._collect import add_collect_parser, run_collect
from ._gc import add_gc_parser, run_gc
from ._live import run_live
from ._offline import inspect_checkpoint, verify_checkpoint
from ._options import DEFAULT_PAUSE_SHARE, add_probe_options
from ._options import share as _share
from ._output import print_error, print_json, table
from ._scope import CheckpointUnreadable, dir_argument
from ._where import CONFIG_ENV, TOKEN_ENV, UsageError

__all__ = ["build_parser", "main"]

USAGE_ERROR = 2
DEFAULT_WATCH = 2.0

TOKEN_HELP = (
    f"the control token, first match wins: --token-file or --token-env (explicit), else the "
    f"config's checkpoint.control_auth_token_env, else {TOKEN_ENV}; the token is never printed"
)
EPILOG = (
    f"deployment: --config or --url, else the Gym config ${CONFIG_ENV} names. {TOKEN_HELP}. "
    "exit status: 0 ok, 1 a server failed or a checkpoint does not verify, 2 usage, 3 prepare not ready"
)


def _positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value} is not a number of seconds") from None
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is not a positive number of seconds")
    return number


def _count(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive whole number")
    return int(value)


def _owner_id(value: str) -> str:
    if not re.fullmatch(OWNER_PATTERN, value) or len(value) > 200:
        raise argparse.ArgumentTypeError(f"{value!r} is not an owner id (letters, digits and ._:@+-, at most 200)")
    return value


def _version() -> str:
    try:
        return importlib.metadata.version("nemo-gym-checkpoint")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _common(json_only: bool = False) -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: the subcommand's --json must not reset a --json given before the subcommand.
    parent.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print one JSON document on stdout, errors included (for scripts)",
    )
    if json_only:
        return parent
    where = parent.add_argument_group("deployment", f"{TOKEN_HELP}.")
    where.add_argument(
        "--config",
        metavar="GYM_YAML",
        help=f"the Gym config: top-level server blocks with host/port (default: ${CONFIG_ENV})",
    )
    where.add_argument(
        "--url",
        action="append",
        metavar="URL",
        help="a server's base URL, e.g. http://127.0.0.1:8001 (repeatable; instead of --config)",
    )
    add_probe_options(where, _positive)
    where.add_argument(
        "--owner",
        type=_owner_id,
        metavar="ID",
        help="the owner id this CLI drives the deployment as (default cli-<user>@<host>); a "
        "deployment another controller owns refuses every command but status, naming it",
    )
    # Seconds between "still waiting" lines when stderr is not a terminal (hidden: for tests and logs).
    where.add_argument("--progress-every", type=_positive, default=10.0, help=argparse.SUPPRESS)
    return parent


def _operation(sub: argparse._SubParsersAction, name: str, help_text: str, parents: list) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_text, description=help_text, parents=parents, epilog=EPILOG)
    parser.add_argument("checkpoint_id", help="the operation's checkpoint id")
    parser.add_argument(
        "--deadline",
        type=_positive,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"seconds from now the participants have to finish (default {DEFAULT_TIMEOUT:g})",
    )
    return parser


def _scope_args(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--episode", action="append", metavar="KEY", help=f"{what}: a capture key (r or r-aN), repeatable"
    )
    parser.add_argument("--episodes-file", metavar="FILE", help="capture keys, one per line")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ng-checkpoint",
        description="Checkpoint a running NeMo Gym deployment, drive it by hand, and check checkpoints offline.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "--json",
        action="store_true",
        default=False,
        help="print one JSON document on stdout, errors included (also accepted after COMMAND)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    live = [_common()]
    status = sub.add_parser(
        "status",
        parents=live,
        epilog=EPILOG,
        help="every participant's kind, phase, checkpoint, lease and notes",
        description="Probe every server and show each participant's kind, phase, checkpoint "
        "id, lease, blockers, restarts and retired rollouts (--json: everything).",
    )
    status.add_argument(
        "--watch",
        nargs="?",
        type=_positive,
        const=DEFAULT_WATCH,
        metavar="SECONDS",
        help=f"refresh every SECONDS (default {DEFAULT_WATCH:g}) until Ctrl-C",
    )
    # Stop a watch after N refreshes (hidden: for tests and scripts that want a bounded watch).
    status.add_argument("--count", type=_count, help=argparse.SUPPRESS)
    status.add_argument(
        "--interval",
        type=_positive,
        metavar="SECONDS",
        help="the checkpoint interval: warn about a server whose last checkpoint paused it longer than "
        "--max-pause-share of it",
    )
    status.add_argument(
        "--max-pause-share",
        type=_share,
        default=DEFAULT_PAUSE_SHARE,
        metavar="FRACTION",
        help=f"with --interval, the share of it a checkpoint may pause a server (default {DEFAULT_PAUSE_SHARE:g})",
    )
    prepare = _operation(sub, "prepare", "close admission stage by stage and wait for readiness", live)
    prepare.add_argument(
        "--take-over",
        action="store_true",
        help="take the deployment over from the controller that owns it, fencing it for good",
    )
    commit = _operation(sub, "commit", "write every participant's state into a checkpoint directory", live)
    commit.add_argument("--dir", required=True, help="the checkpoint directory (shared by every participant)")
    _scope_args(commit, "the commit scope")
    commit.add_argument("--all", action="store_true", help="scope: everything each participant holds")
    commit.add_argument("--stop", action="store_true", help="the controller stops after this checkpoint")
    _operation(sub, "resume", "reopen admission everywhere (reverse order), past failures", live)
    restore = _operation(sub, "restore", "restore a checkpoint everywhere, all or nothing", live)
    restore.add_argument("--dir", required=True, help="the checkpoint directory to restore from")
    _scope_args(restore, "a checkpointed attempt to restore (the checkpoint must hold it)")
    restore.add_argument("--all", action="store_true", help="scope: every episode the checkpoint holds")
    restore.add_argument(
        "--take-over",
        action="store_true",
        help="take the deployment over from the controller that owns it, fencing it for good",
    )
    retire = _operation(sub, "retire", "retire episode attempts everywhere", live)
    _scope_args(retire, "an attempt to retire")
    forget = _operation(sub, "forget", "remove retired marks of rollouts everywhere", live)
    forget.add_argument("--rollout", action="append", required=True, metavar="ID", help="a rollout id, repeatable")
    _operation(sub, "renew", "extend every participant's lease", live)

    offline = [_common(json_only=True)]
    inspect = sub.add_parser(
        "inspect",
        parents=offline,
        help="list a checkpoint directory's participants",
        description="Show each participant of a checkpoint directory: kind, instance, "
        "checkpoint id, record count, records size and digest (no server needed).",
    )
    inspect.add_argument("dir", help="the checkpoint directory")
    inspect.add_argument("--episodes", action="store_true", help="also list every record's capture key")
    verify = sub.add_parser(
        "verify",
        parents=offline,
        help="check every manifest and digest offline",
        description="Verify every participant of a checkpoint directory: manifest fields, "
        "records file inside the participant directory, digest, count, records. "
        "Exit 0 only when all verify.",
    )
    verify.add_argument("dir", help="the checkpoint directory")

    enable = sub.add_parser(
        "enable",
        parents=offline,
        help="checkpoint a Gym config and ready it for ng_run",
        description="Write GYM_YAML checkpointed (every server wrapped, host and port pinned, "
        "the checkpoint: block on, skip_venv_if_present) and make every server's "
        "venv, where Gym's launcher (ng_run) runs it, import the plugin. Run it "
        "from the directory ng_run will run from.",
    )
    enable.add_argument("config", metavar="GYM_YAML", help="your Gym config")
    enable.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        help="where to write the checkpointed config (default: GYM_YAML's name + .checkpointed.yaml; "
        "nothing is written when GYM_YAML already is one)",
    )
    enable.add_argument(
        "--token-env",
        default=TOKEN_ENV,
        metavar="VAR",
        help=f"the token's variable, when the config names none (default {TOKEN_ENV})",
    )

    add_collect_parser(sub, offline[0], _positive, _count)
    add_gc_parser(sub, offline[0], _count)
    return parser


def _offline_dir(args: argparse.Namespace) -> Location:
    if is_url(args.dir):
        where = location(dir_argument(args.dir, "DIR"))
        if not is_dir(where):
            raise CheckpointUnreadable(f"{where} holds nothing (no object under that prefix)")
        return where
    directory = Path(args.dir)
    if not directory.exists():
        raise CheckpointUnreadable(f"{args.dir} does not exist")
    if not directory.is_dir():
        raise CheckpointUnreadable(f"{args.dir} is not a directory")
    return directory


def _inspect(args: argparse.Namespace) -> int:
    checks = inspect_checkpoint(_offline_dir(args), episodes=args.episodes)
    if args.json:
        print_json({"dir": args.dir, "participants": [c.to_json() for c in checks]})
    else:
        rows = [
            [
                c.kind,
                c.instance,
                c.manifest.get("checkpoint_id"),
                c.manifest.get("record_count"),
                c.records_bytes,
                (c.manifest.get("records_sha256") or "")[:12] or None,
                "ok" if c.ok else f"BAD: {c.problem}",
            ]
            for c in checks
        ]
        print(
            table(
                ["KIND", "INSTANCE", "CHECKPOINT", "RECORDS", "BYTES", "SHA256", "STATE"],
                rows,
                wrap=("INSTANCE", "CHECKPOINT", "STATE"),
            )
        )
        for check in checks:
            if check.episodes is not None:
                print(f"{check.name}: {' '.join(check.episodes) or '(no records)'}")
    return 0 if all(c.ok for c in checks) else 1


def _verify(args: argparse.Namespace) -> int:
    warnings: list[str] = []
    checks = verify_checkpoint(_offline_dir(args), warnings)
    ok = bool(checks) and all(c.ok for c in checks)
    error = None
    if not args.json:  # with --json they are told once, in the document
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)
    if not checks:
        error = f"{args.dir} holds no participant directories under gym/"
    elif not ok:
        bad = [c.name for c in checks if not c.ok]
        error = f"{len(bad)} of {len(checks)} participant(s) do not verify: {', '.join(bad)}"
    if args.json:
        document = {"dir": args.dir, "ok": ok, "participants": [c.to_json() for c in checks], "warnings": warnings}
        if error:
            document["error"] = {"code": "does_not_verify", "detail": error}
        print_json(document)
        return 0 if ok else 1
    for check in checks:
        if check.ok:
            manifest = check.manifest
            print(f"ok    {check.name}  {manifest['checkpoint_id']}  {manifest['record_count']} records")
        else:
            print(f"FAIL  {check.name}: {check.problem}")
    if error:
        print(f"error: {error}", file=sys.stderr)
    return 0 if ok else 1


def _enable(args: argparse.Namespace) -> int:
    from ._enable import run_enable

    done = run_enable(args)
    if args.json:
        print_json(done)
        return 0
    for warning in done["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    what = f"wrote {done['written']}" if done["written"] else f"{done['config']} is already checkpointed"
    print(f"{what}; {len(done['servers'])} server environment(s) import the plugin:")
    print(
        table(
            ["NAME", "VENV", "DONE"],
            [[s["name"], s["venv"], s["action"]] for s in done["servers"]],
            wrap=("VENV", "DONE"),
        )
    )
    print(
        f"start it (from {done['cwd']}):\n  export {done['token_env']}=\"$(python -c 'import secrets; "
        f"print(secrets.token_urlsafe(32))')\"\n  {done['ng_run']}\n"
        f"then drive it:\n  export NG_CHECKPOINT_CONFIG={Path(done['config']).resolve()}\n  ng-checkpoint status"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ng-checkpoint``; returns the exit status (``sys.exit`` it)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "verify":
            return _verify(args)
        if args.command == "enable":
            return _enable(args)
        if args.command == "collect":
            return run_collect(args)
        if args.command == "gc":
            return run_gc(args)
        return asyncio.run(run_live(args))
    except UsageError as exc:
        print_error(args.command, str(exc), as_json=args.json, code="usage")
        return USAGE_ERROR
    except CheckpointUnreadable as exc:
        print_error(args.command, str(exc), as_json=args.json, code="checkpoint_unreadable", dir=args.dir)
        return 1
    except InvalidCheckpointState as exc:
        # The store itself failed (its filesystem is not installed, a listing refused): named, never a traceback.
        print_error(
            args.command, exc.detail, as_json=args.json, code="checkpoint_unreadable", dir=getattr(args, "dir", None)
        )
        return 1
    except (FileNotFoundError, NotADirectoryError) as exc:
        # find_participants: a directory without gym/ is not a checkpoint directory.
        print_error(args.command, str(exc), as_json=args.json, code="not_a_checkpoint", dir=args.dir)
        return 1
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        print_error(args.command, f"{exc.strerror or exc}{where}", as_json=args.json, code="io_error")
        return 1
    except KeyboardInterrupt:
        print(f"ng-checkpoint {args.command}: interrupted", file=sys.stderr)
        return 130
