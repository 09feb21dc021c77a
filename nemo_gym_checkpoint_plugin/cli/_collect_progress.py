"""What ``ng-checkpoint collect`` shows while it runs, and the summary at the end.

On a terminal's stderr: a live progress bar (rows done of total, in flight, age of the last
checkpoint) and a line per checkpoint with the time it paused the deployment. When stderr
is not a terminal: only the lines. At the end: a summary table on stderr.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ._output import console, table

__all__ = ["CollectProgress", "collect_summary", "lost_work_line", "pause_warning", "summary_table"]


class CollectProgress:
    """Progress of one collection; ``update`` is cheap and called on every ``/run`` start and end."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.total = 0
        self.done = 0
        self.in_flight = 0
        self.last_checkpoint: float | None = None
        self._progress: Progress | None = None
        self._task: Any = None

    def start(self) -> None:
        if not self.live:
            return
        self._progress = Progress(
            TextColumn("collect"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("in flight {task.fields[in_flight]}  last checkpoint {task.fields[age]}"),
            TimeElapsedColumn(),
            console=console(self.stream),
            transient=False,
            refresh_per_second=4,
        )
        self._task = self._progress.add_task("rows", total=self.total or None, in_flight=0, age="none")
        self._progress.start()

    def stop(self) -> None:
        if self._progress is not None:
            self.update()
            self._progress.stop()
            self._progress = None

    def _age(self) -> str:
        if self.last_checkpoint is None:
            return "none"
        return f"{time.monotonic() - self.last_checkpoint:.0f}s ago"

    def update(self, *, total: int | None = None, done: int | None = None, in_flight: int | None = None) -> None:
        if total is not None:
            self.total = total
        if done is not None:
            self.done = done
        if in_flight is not None:
            self.in_flight = in_flight
        if self._progress is not None:
            self._progress.update(
                self._task, total=self.total or None, completed=self.done, in_flight=self.in_flight, age=self._age()
            )

    def say(self, message: str) -> None:
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False)
        else:
            print(f"[collect] {message}", file=self.stream, flush=True)

    def checkpoint_line(self, record: Any) -> None:
        if record.published:
            self.last_checkpoint = time.monotonic()
            self.say(
                f"checkpoint {record.checkpoint_id}: {record.continued} rows continued, {record.restarts} "
                f"restarts; paused the deployment {record.paused_s:.2f}s (prepare {record.prepare_s:.2f}s, "
                f"commit {record.commit_s:.2f}s)"
            )
        else:
            self.say(
                f"checkpoint {record.checkpoint_id} not published ({record.problem}); paused {record.paused_s:.2f}s"
            )
        self.update()


def pause_warning(record: Any, every: float, share: float) -> str | None:
    """A checkpoint that kept the deployment paused longer than ``share`` of ``every`` (status's rule), or None."""
    allowed = share * every
    if record.paused_s <= allowed:
        return None
    return (
        f"checkpoint {record.checkpoint_id} kept the deployment paused {record.paused_s:.2f}s, more than "
        f"{share:g} of the {every:g}s interval ({allowed:.2f}s)"
    )


def _length(lengths: dict[str, Any] | None) -> str:
    if not lengths:
        return "none"
    return f"{lengths['count']} (model calls min {lengths['min']}, median {lengths['median']:g}, max {lengths['max']})"


def lost_work_line(ledger: dict[str, Any]) -> str:
    """The ledger of a restore in one line (``collect``'s resume and its summary)."""
    repeated = ledger["model_calls_repeated"]
    since = ledger["since_checkpoint_s"]
    lengths = ledger.get("lengths") or {}
    return (
        f"lost work: {ledger['rollouts_lost']} rows lost, {ledger['rollouts_continued']} continued, "
        f"{ledger['rollouts_restarted']} restarted; "
        + (
            "model calls not reported"
            if repeated is None
            else f"{repeated} model calls run again, {ledger.get('model_calls_cut') or 0} cut while running"
        )
        + (
            ""
            if ledger.get("tokens_regenerated") is None
            else f" ({ledger['tokens_regenerated']} output tokens generated again)"
        )
        + (
            ""
            if ledger.get("tool_calls_repeated") is None
            else f"; {ledger['tool_calls_repeated']} tool calls run again"
        )
        + ("" if since is None else f"; {since:.1f}s since checkpoint {ledger['checkpoint_id']}")
        + f"; continued {_length(lengths.get('continued'))}, restarted {_length(lengths.get('restarted'))}"
    )


def _drained(drain: dict[str, Any] | None) -> str | None:
    if drain is None:
        return None
    if drain["published"]:
        return f"last checkpoint {drain['checkpoint']} published (budget {drain['budget_s']:g}s)"
    return f"without a last checkpoint ({drain['problem'] or 'stopped'})"


def summary_table(summary: dict[str, Any]) -> str:
    """The end-of-run summary as a two-column table."""
    pauses = summary["pause_s"]
    rows = [
        ["rows", summary["rollouts"]],
        ["finished (rows in the output)", summary["finished"]],
        ["failed for good", len(summary["terminal_failures"]) or None],
        ["missing (--resume runs them)", len(summary["missing"]) or None],
        ["in the output twice or more", len(summary["duplicated"]) or None],
        ["finished before this run", summary["finished_before"]],
        ["continued from a checkpoint", summary["continued"]],
        ["started over", summary["restarted"]],
        ["of them retired, sent as the next attempt", summary.get("retired_restarts") or None],
        ["checkpoints published", f"{summary['checkpoints']} of {summary['checkpoint_attempts']}"],
        [
            "deployment paused per checkpoint",
            (f"mean {pauses['mean']:.2f}s, max {pauses['max']:.2f}s" if summary["checkpoints"] else None),
        ],
        [
            "restore",
            f"{summary['restore_s']:.2f}s from {summary['restored_from']}" if summary["restored_from"] else None,
        ],
        ["lost work", lost_work_line(summary["lost_work"]) if summary.get("lost_work") else None],
        ["pause warnings", len(summary.get("pause_warnings") or ()) or None],
        ["fallbacks", "; ".join(f"{cid}: {why}" for cid, why in summary["fallbacks"]) or None],
        ["rollouts forgotten", summary["forgotten"]],
        ["stopped on SIGTERM", _drained(summary.get("drain"))],
        ["checkpoint dir", summary["checkpoint_dir"]],
    ]
    return table(["COLLECTION", ""], rows, wrap=("",))


def collect_summary(
    root: Any, helper: Any, checkpointer: Any, plan: Any, outcome: Any, elapsed: float, drain: Any
) -> dict[str, Any]:
    """The ``--json`` summary of one collection (``outcome``: its ``Tally``, read from Gym's files)."""
    published = [c for c in checkpointer.checkpoints if c.published]
    pauses = [c.paused_s for c in checkpointer.checkpoints]
    return {
        "rollouts": outcome.rows,
        "finished": outcome.finished,
        **outcome.to_json(),
        "lives_elsewhere": sorted(set(helper.tracker.elsewhere)),
        "finished_before": helper.done_before,
        "continued": len(plan.continued),
        "restarted": len(plan.restarted),
        "retired_restarts": len(plan.retired),
        "restored_from": plan.source,
        "restore_s": round(plan.restore_s, 3),
        "restore_problem": plan.problem,
        "fallbacks": [list(f) for f in plan.fallbacks],
        "checkpoints": len(published),
        "checkpoint_attempts": len(checkpointer.checkpoints),
        "prepare_s": round(max((c.prepare_s for c in published), default=0.0), 3),
        "commit_s": round(max((c.commit_s for c in published), default=0.0), 3),
        "pause_s": {"mean": sum(pauses) / len(pauses) if pauses else 0.0, "max": max(pauses, default=0.0)},
        "forgotten": checkpointer.forgotten,
        "elapsed_s": round(elapsed, 3),
        "checkpoint_dir": str(root),
        "drain": drain.to_json(),
        "lost_work": plan.lost_work.to_json() if plan.lost_work is not None else None,
    }
