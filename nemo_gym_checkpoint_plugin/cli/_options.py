"""Options every command that reaches live servers shares: the control token and the status probes."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

__all__ = ["DEFAULT_PAUSE_SHARE", "add_probe_options", "share"]

# The share of the checkpoint interval a checkpoint may pause the deployment before status and collect warn.
DEFAULT_PAUSE_SHARE = 0.1


def share(value: str) -> float:
    """``--max-pause-share``'s type: more than 0, at most 1."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value} is not a number") from None
    if not 0 < number <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not a share of the interval (more than 0, at most 1)")
    return number


def add_probe_options(group: Any, positive: Callable[[str], float]) -> None:
    """``--token-file``/``--token-env`` (one of them), ``--probe-timeout`` and ``--tries`` on ``group``.

    ``group`` is a parser or an argument group (``argparse`` gives both ``add_argument``).
    """
    token = group.add_mutually_exclusive_group()
    token.add_argument("--token-file", metavar="PATH", help="a file holding the control token")
    token.add_argument("--token-env", metavar="VAR", help="environment variable holding the control token")
    group.add_argument(
        "--probe-timeout",
        type=positive,
        default=2.0,
        metavar="S",
        help="seconds to wait for each status probe (default 2)",
    )
    group.add_argument("--tries", type=int, default=3, metavar="N", help="status probes per server (default 3)")
