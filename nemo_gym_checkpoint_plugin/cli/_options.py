"""Options every command that reaches live servers shares: the control token and the status probes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["add_probe_options"]


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
