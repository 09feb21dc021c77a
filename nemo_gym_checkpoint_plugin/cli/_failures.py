"""Server failures told once each, in words: a refused token is one message, not one per server.

A wrong token makes every server answer 401 ``unauthorized``; discovery then also finds
"no model participant", which is only a consequence. ``explain`` folds every 401 into one
line naming where the token was read from and drops that follow-on failure.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..coordination import CoordinationError, ParticipantFailure
from ..coordination._errors import NO_MODEL_PARTICIPANT
from ._output import words
from ._where import Deployment

__all__ = ["UNAUTHORIZED", "explain", "explain_error", "token_refused"]

UNAUTHORIZED = "unauthorized"


def token_refused(refused: Sequence[ParticipantFailure], total: int, deployment: Deployment | None) -> str:
    names = words(sorted({f.server for f in refused}))
    who = f"every server ({total})" if len(refused) >= total else f"{len(refused)} of {total} servers ({names})"
    source = deployment.token_source if deployment is not None else "the token given"
    return (
        f"the control token was refused (HTTP 401 unauthorized) by {who}: it was read from {source}, "
        "and it is not the token the servers were started with"
    )


def explain(
    failures: Sequence[ParticipantFailure], deployment: Deployment | None, servers: int | None = None
) -> tuple[list[str], list[ParticipantFailure]]:
    """Lines for stderr (one per failure, one for all 401s) and the failures worth telling.

    ``servers`` is how many servers the command talked to (default: those that failed).
    """
    refused = [f for f in failures if f.code == UNAUTHORIZED]
    kept = [f for f in failures if f.code != UNAUTHORIZED and not (refused and f.code == NO_MODEL_PARTICIPANT)]
    lines = [f.describe() for f in kept]
    if refused:
        total = servers if servers is not None else len({f.server for f in failures if f.url})
        lines.insert(0, token_refused(refused, total, deployment))
    return lines, kept + refused


def explain_error(exc: CoordinationError, deployment: Deployment | None, servers: int | None = None) -> str:
    """The error's headline and its failures, each once (401s folded), then any clean-up failures."""
    headline = str(exc).splitlines()[0]
    lines, shown = explain(exc.failures, deployment, servers)
    if all(f.code == UNAUTHORIZED for f in shown) and not exc.cleanup_failures:
        return lines[0]  # only the refused token: the headline's server count would mislead
    text = [headline, *(f"  {line}" for line in lines)]
    if exc.cleanup_failures:
        cleanup, _ = explain(exc.cleanup_failures, deployment, servers)
        text.append(f"  clean-up also failed on {len(exc.cleanup_failures)} call(s):")
        text += [f"    {line}" for line in cleanup]
    return "\n".join(text)
