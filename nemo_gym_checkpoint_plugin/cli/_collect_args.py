"""``ng-checkpoint collect``'s arguments (the command itself: ``_collect.py``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ._collect_drain import DEFAULT_DRAIN_BUDGET
from ._options import DEFAULT_PAUSE_SHARE, add_probe_options, share

__all__ = ["DEFAULT_EVERY", "DEFAULT_KEEP", "add_collect_parser"]

DEFAULT_EVERY = 60.0
DEFAULT_KEEP = 2


def add_collect_parser(
    sub: argparse._SubParsersAction,
    common: argparse.ArgumentParser,
    positive: Callable[[str], float],
    count: Callable[[str], int],
) -> None:
    parser = sub.add_parser(
        "collect",
        parents=[common],
        help="run Gym's rollout collection, checkpointing the rows in flight",
        description="Run Gym's own rollout collection (the configuration ng_collect_rollouts takes, as Gym's "
        "+key=value overrides) and checkpoint the deployment while rows are in flight; --resume "
        "continues after a crash of the deployment and the collector.",
        epilog="example: ng-checkpoint collect --checkpoint-dir /ckpt/run1 --checkpoint-every 300 "
        "'+config_paths=[gym.yaml]' +input_jsonl_fpath=in.jsonl +output_jsonl_fpath=out.jsonl. "
        "exit status: 0 done (every row once in the output, or failed for good), or stopped on SIGTERM "
        "with a last checkpoint published, 1 the collection or the "
        "deployment failed, a row is missing or twice in the output at the end (named), or a SIGTERM "
        "stopped it without a last checkpoint, 2 usage, or the "
        "deployment holds retired marks this collection did not make (named, with the forget command)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        required=True,
        metavar="DIR",
        help="absolute directory holding the checkpoints (its parent must exist), or an "
        "object-store URL (s3://bucket/run; the servers need checkpoint.storage.backend: fsspec)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=positive,
        default=DEFAULT_EVERY,
        metavar="SECONDS",
        help=f"seconds between checkpoints while rows are in flight (default {DEFAULT_EVERY:g})",
    )
    parser.add_argument(
        "--keep",
        type=count,
        default=DEFAULT_KEEP,
        metavar="K",
        help=f"published checkpoints kept (default {DEFAULT_KEEP}); older ones are removed only "
        "after a newer one is published, and only this collection's",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue a crashed collection: Gym's resume_from_cache, and the rows in flight at "
        "the last published checkpoint continue as their next attempt",
    )
    parser.add_argument(
        "--allow-shared-root",
        action="store_true",
        help="use a --checkpoint-dir other users can write (refused without it: they could "
        "redirect or forge checkpoints), with a warning",
    )
    parser.add_argument(
        "--take-over",
        action="store_true",
        help="take the deployment over from the controller that owns it (it is fenced for good); "
        "without it, a deployment another controller owns is refused, naming it",
    )
    parser.add_argument(
        "--drain-budget",
        type=positive,
        default=DEFAULT_DRAIN_BUDGET,
        metavar="SECONDS",
        help=f"on SIGTERM (a preemption notice), seconds to prepare, commit and publish one last checkpoint "
        f"before stopping (default {DEFAULT_DRAIN_BUDGET:g}); exit 0 with the --resume line when it is "
        "published, 1 when the budget ends or a second SIGTERM comes first (nothing of it published)",
    )
    parser.add_argument(
        "--max-pause-share",
        type=share,
        default=DEFAULT_PAUSE_SHARE,
        metavar="FRACTION",
        help="warn when a checkpoint kept the deployment paused longer than this share of --checkpoint-every "
        f"(default {DEFAULT_PAUSE_SHARE:g}; status --max-pause-share's rule)",
    )
    parser.add_argument(
        "--checkpoint-timeout",
        type=positive,
        default=60.0,
        metavar="S",
        help="seconds each prepare, commit and restore may take (default 60)",
    )
    add_probe_options(parser, positive)
    parser.add_argument(
        "gym_overrides",
        nargs=argparse.REMAINDER,
        metavar="+KEY=VALUE",
        help="ng_collect_rollouts' configuration (Gym's overrides)",
    )
