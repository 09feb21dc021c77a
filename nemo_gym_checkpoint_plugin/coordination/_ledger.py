"""The lost-work ledger: what a crash cost, figured at the restore from the checkpoint it restores.

After a crash the servers are fresh: the only account of the work done before it is the checkpoint
(docs/telemetry.md, "The lost-work ledger"). Per row in flight the collector's state holds what the
model participants reported in their commit replies (``answered_calls``: model calls answered so far,
``held_calls``: answered, the response held by the checkpoint; ``running_calls``: not answered yet;
docs/protocol.md). From it:

- ``rollouts_lost``: rows of the checkpoint neither finished, continued nor restarted (always 0; a
  figure above 0 is a bug);
- ``rollouts_continued`` / ``rollouts_restarted``: as the restore decided them;
- ``model_calls_repeated``: every call a restarted row had answered, plus every held response of a
  continued row (its answer never reached the agent: the call runs again); ``None`` when no
  participant reported calls (no model participant);
- ``model_calls_cut``: calls of continued and restarted rows still running at the checkpoint (not
  answered yet): they are sent again whole, whatever the worker had generated of them;
- ``tool_calls_repeated``: every tool call a restarted row had answered (``answered_tool_calls`` of the
  resources participants); ``None`` when none reported them;
- ``since_checkpoint_s``: wall time from the checkpoint's publish to this restore: the work done
  after the checkpoint (not in it, so not counted above) happened within it;
- ``lengths``: the distribution of model calls answered so far (count, min, median, max) of the
  continued and of the restarted rows (restarts hitting the longest rows is the bias to watch).

- ``tokens_regenerated``: the output tokens of the calls counted in ``model_calls_repeated`` (every
  answered call of a restarted row, every held response of a continued row), as their answers' usage
  reported them (``answered_output_tokens`` and ``held_output_tokens``); ``None`` when no model server
  reported tokens at the checkpoint. Calls still running (``model_calls_cut``) are not in it: their
  tokens were never reported.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["LEDGER_EXTRAS", "LostWork", "ledger_counts", "lost_work"]


@dataclass
class LostWork:
    """One restore's ledger (``to_json`` is the ``lost_work`` object of ``collect --json``)."""

    checkpoint_id: str | None
    rollouts_lost: int = 0
    rollouts_continued: int = 0
    rollouts_restarted: int = 0
    model_calls_repeated: int | None = None
    model_calls_repeated_by: dict[str, int] | None = None
    model_calls_cut: int | None = None
    tool_calls_repeated: int | None = None
    tokens_regenerated: int | None = None
    since_checkpoint_s: float | None = None
    lengths: dict[str, dict[str, float] | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


LEDGER_EXTRAS = (
    "answered_calls",
    "held_calls",
    "running_calls",
    "answered_tool_calls",
    "answered_output_tokens",
    "held_output_tokens",
)


def ledger_counts(replies: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """Each of ``LEDGER_EXTRAS``: per capture key, added up over every participant's commit reply."""
    counts: dict[str, dict[str, int]] = {name: {} for name in LEDGER_EXTRAS}
    for reply in replies.values():
        for name, target in counts.items():
            source = reply.get(name)
            if not isinstance(source, Mapping):
                continue
            for key, count in source.items():
                if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
                    target[key] = target.get(key, 0) + count
    return counts


def _distribution(values: list[int]) -> dict[str, float] | None:
    if not values:
        return None
    return {"count": len(values), "min": min(values), "median": statistics.median(values), "max": max(values)}


def lost_work(
    checkpoint_id: str | None,
    rows: Iterable[Any],
    continued: Iterable[str],
    restarted: Iterable[str],
    finished: Iterable[str] = (),
    *,
    published_at: float | None = None,
    restored_at: float | None = None,
) -> LostWork:
    """The ledger of a restore of ``rows`` (``RowState``: ``rollout_id``, ``model_calls``, ``held_calls``,
    ``running_calls``, ``tool_calls``, ``output_tokens``, ``held_output_tokens``).

    ``continued`` and ``restarted`` are rollout ids as the restore decided them, ``finished`` those
    already in the output (neither lost nor run again).
    """
    by_id = {row.rollout_id: row for row in rows}
    went_on, over, done = set(continued), set(restarted), set(finished)
    ledger = LostWork(
        checkpoint_id,
        rollouts_lost=len(set(by_id) - went_on - over - done),
        rollouts_continued=len(went_on & set(by_id)),
        rollouts_restarted=len(over & set(by_id)),
    )
    if published_at is not None and restored_at is not None:
        ledger.since_checkpoint_s = round(max(restored_at - published_at, 0.0), 3)
    reported = [row for row in by_id.values() if getattr(row, "model_calls", None) is not None]
    if reported:
        repeated_restarted = sum(row.model_calls for row in reported if row.rollout_id in over)
        repeated_held = sum(row.held_calls or 0 for row in reported if row.rollout_id in went_on)
        ledger.model_calls_repeated = repeated_restarted + repeated_held
        ledger.model_calls_repeated_by = {"restarted": repeated_restarted, "held": repeated_held}
        ledger.model_calls_cut = sum(row.running_calls or 0 for row in reported if row.rollout_id in went_on | over)
    tokened = [row for row in by_id.values() if getattr(row, "output_tokens", None) is not None]
    if tokened:
        ledger.tokens_regenerated = sum(row.output_tokens for row in tokened if row.rollout_id in over) + sum(
            row.held_output_tokens or 0 for row in tokened if row.rollout_id in went_on
        )
    tooled = [row for row in by_id.values() if getattr(row, "tool_calls", None) is not None]
    if tooled:
        ledger.tool_calls_repeated = sum(row.tool_calls for row in tooled if row.rollout_id in over)
    ledger.lengths = {
        "continued": _distribution([r.model_calls for r in reported if r.rollout_id in went_on]),
        "restarted": _distribution([r.model_calls for r in reported if r.rollout_id in over]),
    }
    return ledger
