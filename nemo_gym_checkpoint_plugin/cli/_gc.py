"""``ng-checkpoint gc DIR --keep K``: remove old checkpoints of a directory (or object-store prefix).

The rule is ``_storage.retention``'s, the one ``collect --keep`` applies: the ``K`` newest
published checkpoints stay, so does one a commit or restore is using (a live lease) and a
write in progress; older published ones and abandoned writes go. A dry run unless ``--yes``:
it lists what would be removed and why each other one stays. With ``--yes`` each removal checks
the leases again first, and takes the publish marker before the rest.

Exit status: 0 done (or nothing to do); 1 a removal failed; 2 usage.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from .._errors import InvalidCheckpointState
from .._storage.location import child_dirs, is_dir, location
from .._storage.objstore import is_url
from .._storage.retention import Checkpoint, plan_retention, remove_checkpoint
from ._output import print_json, table
from ._scope import dir_argument
from ._where import UsageError

__all__ = ["add_gc_parser", "run_gc"]


def add_gc_parser(
    sub: argparse._SubParsersAction, common: argparse.ArgumentParser, count: Callable[[str], int]
) -> None:
    parser = sub.add_parser(
        "gc",
        parents=[common],
        help="remove old checkpoints, keeping the K newest and any in use",
        description="Remove old checkpoints of DIR (a directory or an object-store URL holding checkpoint "
        "directories, as collect --checkpoint-dir does): keep the K newest published ones, any a "
        "commit or restore is using (its lease) and any write in progress. Lists what it would do; "
        "removes only with --yes.",
        epilog="exit status: 0 done, 1 a removal failed, 2 usage",
    )
    parser.add_argument("dir", metavar="DIR", help="the directory (or s3://... prefix) holding the checkpoints")
    parser.add_argument("--keep", type=count, required=True, metavar="K", help="published checkpoints kept")
    parser.add_argument("--yes", action="store_true", help="remove them (without it: a dry run)")


def _root(raw: str) -> Any:
    where = location(dir_argument(raw, "DIR"))
    if not is_url(raw) and not is_dir(where):
        raise UsageError(f"{raw} is not a directory")
    if {"gym", "collector"} & set(child_dirs(where)):
        raise UsageError(f"{where} is a checkpoint itself; give the directory holding checkpoints")
    return where


def _row(checkpoint: Checkpoint, action: str, why: str) -> dict[str, Any]:
    return {
        "name": checkpoint.name,
        "published": checkpoint.published,
        "action": action,
        "why": why,
        "leases": [lease.describe() for lease in checkpoint.leases],
    }


def run_gc(args: argparse.Namespace) -> int:
    root = _root(args.dir)
    now = time.time()
    plan = plan_retention(root, args.keep, now=now)
    rows = [
        _row(c, "remove", "older than the newest kept" if c.published else "an abandoned write") for c in plan.remove
    ]
    rows += [_row(c, "keep", f"one of the {args.keep} newest published") for c in plan.kept]
    rows += [
        _row(c, "keep", "in use: " + "; ".join(lease.describe() for lease in c.leases if lease.live(now)))
        for c in plan.in_use
    ]
    rows += [
        _row(c, "keep", "a write in progress (newer than the oldest kept, not published)") for c in plan.in_progress
    ]
    removed, failed = [], []
    if args.yes:
        for checkpoint in plan.remove:
            try:
                if remove_checkpoint(checkpoint):
                    removed.append(checkpoint.name)
                else:
                    failed.append((checkpoint.name, "a lease appeared: now in use, kept"))
            except InvalidCheckpointState as exc:
                failed.append((checkpoint.name, exc.detail))
    order = {
        c.name: index
        for index, c in enumerate(
            sorted([*plan.remove, *plan.kept, *plan.in_use, *plan.in_progress], key=lambda c: c.order, reverse=True)
        )
    }
    rows.sort(key=lambda row: order[row["name"]])
    if args.json:
        print_json(
            {
                "dir": str(root),
                "keep": args.keep,
                "dry_run": not args.yes,
                "checkpoints": rows,
                "removed": removed,
                "failed": [{"name": n, "problem": p} for n, p in failed],
            }
        )
        return 1 if failed else 0
    if rows:
        print(
            table(
                ["CHECKPOINT", "STATE", "ACTION", "WHY"],
                [
                    [
                        r["name"],
                        "published" if r["published"] else "unpublished",
                        ("removed" if r["name"] in removed else r["action"]),
                        r["why"],
                    ]
                    for r in rows
                ],
                wrap=("CHECKPOINT", "WHY"),
            )
        )
    else:
        print(f"{root} holds no checkpoints")
    for name, problem in failed:
        print(f"ng-checkpoint gc: {name}: not removed: {problem}", file=sys.stderr)
    if not args.yes:
        count = len(plan.remove)
        print(f"dry run: {count} checkpoint(s) would be removed" + ("; pass --yes to remove them" if count else ""))
    else:
        print(f"removed {len(removed)} checkpoint(s)")
    return 1 if failed else 0
