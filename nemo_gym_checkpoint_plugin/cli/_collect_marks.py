"""``collect`` refuses leftover retired marks before it restores or dispatches anything.

A mark refuses every attempt of its rollout up to the marked one (``stale_attempt``). Marks this
collection did not make (a restore or retire by hand, a controller that stopped before it forgot
its rows) would make Gym's collection die on the first such row; so once the collector owns the
deployment, and before its own restore marks anything, it reads every participant's marks
(``status``: the count ``retired_rollouts`` and this plugin's ``retired_marks``, at most 100 of
them by name) and refuses (exit 2) naming the rollouts and the ``forget`` command that removes them.

Which marks are leftovers: without ``--resume``, every one (a collection that ends forgets the marks
of its rows, so a clean deployment holds none). With ``--resume``, a mark that would refuse the
attempt a row is about to be sent as: a rollout not finished in the output whose mark reaches the
attempt the checkpoint continues it as (its checkpointed attempt + 1), or any attempt for a rollout
the checkpoint does not hold (sent as attempt 0). Marks below those are the crashed collector's own
and refuse only the dead executions, which is what they are for.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..coordination import Coordinator

__all__ = ["Leftovers", "leftover_marks", "marks_refusal", "token_arguments"]

# Rollouts named in the message and in the forget command it prints.
SHOWN = 20


@dataclass
class Leftovers:
    """The marks that would refuse rows of this collection."""

    named: dict[str, int] = field(default_factory=dict)  # rollout -> highest marked attempt
    # Servers whose count exceeds the marks they name (more than 100, or no ``retired_marks`` field).
    unnamed: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.named or self.unnamed)


async def leftover_marks(
    coordinator: Coordinator, timeout: float, *, resume: bool, next_attempts: dict[str, int], finished: Iterable[str]
) -> Leftovers:
    """The leftover marks (module docstring); ``next_attempts``: rollout -> attempt a resume sends it as."""
    statuses, _failures = await coordinator.status(timeout=timeout)
    done = set(finished) if resume else set()
    leftovers = Leftovers()
    for name, status in statuses.items():
        count = int(status.get("retired_rollouts") or 0)
        marks = status.get("retired_marks")
        marks = {r: a for r, a in marks.items() if isinstance(a, int)} if isinstance(marks, dict) else {}
        for rollout, attempt in marks.items():
            if rollout in done or (resume and attempt < next_attempts.get(rollout, 0)):
                continue
            leftovers.named[rollout] = max(leftovers.named.get(rollout, attempt), attempt)
        if count > len(marks) and not resume:
            # Names not reported: with --resume they may all be the crashed collector's own; a row
            # one of them refuses then fails with its code and detail (never a bare 409).
            leftovers.unnamed[name] = count - len(marks)
    return leftovers


def marks_refusal(leftovers: Leftovers, urls: list[str], token_args: list[str]) -> str:
    """The refusal naming the marked rollouts and the ``ng-checkpoint forget`` command to run."""
    rollouts = sorted(leftovers.named)
    shown = rollouts[:SHOWN]
    parts = [f"{r} (attempts up to {leftovers.named[r]})" for r in shown]
    if len(rollouts) > len(shown):
        parts.append(f"and {len(rollouts) - len(shown)} more")
    if leftovers.unnamed:
        parts.append("unnamed marks on " + ", ".join(f"{n} ({c})" for n, c in sorted(leftovers.unnamed.items())))
    where = " ".join(f"--url {shlex.quote(u)}" for u in urls) + "".join(f" {shlex.quote(a)}" for a in token_args)
    command = f"ng-checkpoint forget forget-leftover-marks {where} " + " ".join(
        f"--rollout {shlex.quote(r)}" for r in shown
    )
    rest = (
        " (then run collect again; ng-checkpoint status --json lists up to 100 marks per server as retired_marks)"
        if len(rollouts) > len(shown) or leftovers.unnamed
        else ""
    )
    return (
        "the deployment holds retired marks this collection did not make (left by a restore or retire by "
        "hand, or by a controller that stopped): " + "; ".join(parts) + ". Their rows would be refused 409 "
        "stale_attempt; nothing was restored or dispatched. Remove them first"
        + (f": {command}" if shown else " (ng-checkpoint forget --rollout ID ...)")
        + rest
    )


def token_arguments(args: Any) -> list[str]:
    """The token flags ``collect`` was given, for the printed command (never the token itself)."""
    if getattr(args, "token_file", None):
        return ["--token-file", args.token_file]
    if getattr(args, "token_env", None):
        return ["--token-env", args.token_env]
    return []
