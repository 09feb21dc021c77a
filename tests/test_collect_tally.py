"""The end of a collection, read from Gym's files: finished, failed for good, missing, duplicated."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from nemo_gym.path_utils import failures_path_for, materialized_path_for

from nemo_gym_checkpoint_plugin.cli._collect_tally import finished_rollouts, tally


def _row(task: int, **extra: Any) -> dict[str, Any]:
    return {"_ng_task_index": task, "_ng_rollout_index": 0, **extra}


def _write(path: Path, records: list[dict[str, Any]], torn: bool = False) -> None:
    text = "".join(json.dumps(r) + "\n" for r in records)
    path.write_text(text + ('{"_ng_task_index": 9, "_ng' if torn else ""))


def _collection(tmp_path: Path) -> SimpleNamespace:
    output = tmp_path / "out.jsonl"
    return SimpleNamespace(
        output_jsonl_fpath=str(output),
        materialized_jsonl_fpath=materialized_path_for(output),
        retry_terminal_timeouts=False,
    )


def test_rows_once_in_the_output_or_failed_for_good_are_exact(tmp_path: Path) -> None:
    collection = _collection(tmp_path)
    _write(collection.materialized_jsonl_fpath, [_row(i) for i in range(4)])
    _write(Path(collection.output_jsonl_fpath), [_row(0, reward=1.0), _row(1), _row(3)], torn=True)
    # Row 2 failed for good (Gym's terminal stamp); row 1 failed once before it finished.
    _write(
        failures_path_for(Path(collection.output_jsonl_fpath)),
        [_row(2, _ng_failure_class="x", _ng_failure_terminal=True), _row(1, _ng_failure_class="x")],
    )
    result = tally(collection)
    assert (result.rows, result.finished, result.terminal, result.missing) == (4, 3, ["2-0"], [])
    assert result.exact and result.problems() == []
    assert finished_rollouts(Path(collection.output_jsonl_fpath)) == {"0-0", "1-0", "3-0"}


def test_a_missing_or_duplicated_row_is_an_error_naming_it(tmp_path: Path) -> None:
    collection = _collection(tmp_path)
    _write(collection.materialized_jsonl_fpath, [_row(i) for i in range(5)])
    _write(Path(collection.output_jsonl_fpath), [_row(0), _row(1), _row(1), _row(4), _row(7)])
    # Row 2 failed, but not for good: --resume retries it, so it is missing, not terminal.
    _write(failures_path_for(Path(collection.output_jsonl_fpath)), [_row(2, _ng_failure_class="timeout")])
    result = tally(collection)
    assert result.finished == 3 and result.missing == ["2-0", "3-0"] and result.duplicated == ["1-0"]
    assert result.unexpected == ["7-0"] and not result.exact
    assert result.problems() == [
        "2 of 5 rows are not in the output (2-0, 3-0); --resume runs them",
        "1 rows are in the output more than once (1-0)",
        "1 rows in the output are not rows of this collection (7-0)",
    ]


def test_a_row_that_used_every_attempt_is_failed_for_good(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEMO_GYM_MAX_ROLLOUT_ATTEMPTS", "2")
    collection = _collection(tmp_path)
    _write(collection.materialized_jsonl_fpath, [_row(0)])
    _write(failures_path_for(Path(collection.output_jsonl_fpath)), [_row(0, _ng_failure_class="x")] * 2)
    assert tally(collection).terminal == ["0-0"]
