"""What a collection really holds at its end, read from Gym's files, never from the collector's belief.

A summary that counted the ``/run`` replies the collector saw once claimed every row finished
while rows were missing (a second controller's rows, terminal failures counted as replies).
``tally`` reads the files Gym wrote instead:

- the **rows**: Gym's materialized input (``<output>_materialized_inputs.jsonl``, every row of the
  collection, written at its start and kept for ``resume_from_cache``), each named by the rollout
  id Gym gives it on the wire;
- **finished**: rows in the output file, each counted once; a row there twice is **duplicated**;
- **terminal**: rows not in the output whose last attempt in Gym's failures sidecar is final by
  Gym's own rule (``is_terminal_failure``, or the ``NEMO_GYM_MAX_ROLLOUT_ATTEMPTS`` reached): a resume
  never retries them, so they are reported as such;
- **missing**: every other row. ``--resume`` runs them (a non-terminal failure, a row whose attempt
  lived elsewhere, a row the collection never reached).

A torn last line (a crash mid-write) is skipped, as Gym's resume drops it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

__all__ = ["Tally", "finished_rollouts", "tally"]

# Rows named in a message before "and N more".
NAMED = 20


@dataclass
class Tally:
    rows: int = 0
    finished: int = 0
    duplicated: list[str] = field(default_factory=list)
    terminal: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        """Every row once in the output or finally failed; none twice, none foreign."""
        return not (self.missing or self.duplicated or self.unexpected)

    def missing_line(self) -> str | None:
        """The rows not in the output, named, and that ``--resume`` runs them (None: none)."""
        if not self.missing:
            return None
        shown = _names(self.missing)
        return f"{len(self.missing)} of {self.rows} rows are not in the output ({shown}); --resume runs them"

    def problems(self, *, missing: bool = True) -> list[str]:
        """The errors, in words, naming the rows (``missing`` false: all but the missing rows)."""
        problems = []
        if missing and (line := self.missing_line()) is not None:
            problems.append(line)
        if self.duplicated:
            problems.append(f"{len(self.duplicated)} rows are in the output more than once ({_names(self.duplicated)})")
        if self.unexpected:
            problems.append(
                f"{len(self.unexpected)} rows in the output are not rows of this collection ({_names(self.unexpected)})"
            )
        return problems

    def to_json(self) -> dict[str, Any]:
        return {
            "terminal_failures": self.terminal,
            "missing": self.missing,
            "duplicated": self.duplicated,
            "unexpected": self.unexpected,
        }


def _names(ids: list[str]) -> str:
    shown = ", ".join(ids[:NAMED])
    return shown + (f" and {len(ids) - NAMED} more" if len(ids) > NAMED else "")


def _records(path: Path) -> Iterator[dict[str, Any]]:
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        return
    with handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # a torn last line
            if isinstance(record, dict):
                yield record


def _rollout_id(record: dict[str, Any]) -> str | None:
    from ..coordination._collection import row_rollout_id

    try:
        return row_rollout_id(record)
    except (KeyError, TypeError, ValueError):
        return None


def finished_rollouts(output: Path) -> set[str]:
    """Rollout ids of the rows in Gym's output file."""
    return {rollout for record in _records(output) if (rollout := _rollout_id(record)) is not None}


def tally(collection: Any) -> Tally:
    """The tally of ``collection`` (Gym's ``RolloutCollectionConfig``) from its files."""
    from nemo_gym.path_utils import failures_path_for
    from nemo_gym.rollout_collection import get_max_rollout_attempts, is_terminal_failure

    output = Path(collection.output_jsonl_fpath)
    expected = list(
        dict.fromkeys(
            rollout
            for record in _records(Path(collection.materialized_jsonl_fpath))
            if (rollout := _rollout_id(record)) is not None
        )
    )
    written = Counter(rollout for record in _records(output) if (rollout := _rollout_id(record)) is not None)
    if not expected:
        # No materialized input (Gym writes it first; a run that failed before): judge the output alone.
        expected = list(written)
    attempts: Counter[str] = Counter()
    final: set[str] = set()
    retry_timeouts = bool(getattr(collection, "retry_terminal_timeouts", False))
    for record in _records(failures_path_for(output)):
        rollout = _rollout_id(record)
        if rollout is None:
            continue
        attempts[rollout] += 1
        if is_terminal_failure(record, retry_terminal_timeouts=retry_timeouts):
            final.add(rollout)
    most = get_max_rollout_attempts()
    final |= {rollout for rollout, count in attempts.items() if count >= most}
    known = set(expected)
    result = Tally(rows=len(expected), finished=sum(1 for rollout in expected if written[rollout]))
    result.duplicated = sorted((r for r, n in written.items() if n > 1), key=_order)
    result.unexpected = sorted((r for r in written if r not in known), key=_order)
    result.terminal = [r for r in expected if not written[r] and r in final]
    result.missing = [r for r in expected if not written[r] and r not in final]
    return result


def _order(rollout: str) -> tuple[Any, ...]:
    # "<task>-<rollout>" in numeric order when it is one, else by text.
    head, _, tail = rollout.partition("-")
    return (0, int(head), int(tail), "") if head.isdigit() and tail.isdigit() else (1, 0, 0, rollout)
