"""The lost-work ledger's arithmetic, its row figures on disk, and how ``collect`` shows it (in-process).

The real-process check (figures equal to the fake backend's counters) is in test_collect_lost_work.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from nemo_gym_checkpoint_plugin._storage.index import write_participants_index
from nemo_gym_checkpoint_plugin.cli import build_parser
from nemo_gym_checkpoint_plugin.cli._collect_progress import (
    collect_summary,
    lost_work_line,
    pause_warning,
    summary_table,
)
from nemo_gym_checkpoint_plugin.coordination import LostWork, ledger_counts, lost_work
from nemo_gym_checkpoint_plugin.coordination._checkpointer import RestorePlan
from nemo_gym_checkpoint_plugin.coordination._collector_state import CheckpointStore, CollectorState, RowState

IDENTITY = {"participants": ["model/policy"], "output": "/x/out.jsonl"}


def _rows() -> list[RowState]:
    return [
        RowState("0-0", 0, "continued", model_calls=3, held_calls=1),
        RowState("1-0", 0, "continued", model_calls=1, held_calls=0, running_calls=1),
        RowState("2-0", 1, "restart", model_calls=4, held_calls=0, running_calls=1),
        RowState("3-0", 0, "uncaptured", model_calls=0, held_calls=0),
        RowState("4-0", 0, "continued", model_calls=7, held_calls=2),  # finished before the crash
    ]


def test_restarted_rows_repeat_every_answered_call_continued_ones_their_held_responses() -> None:
    ledger = lost_work(
        "collect-000003-0a1b2c3d",
        _rows(),
        continued=["0-0", "1-0"],
        restarted=["2-0", "3-0"],
        finished=["4-0"],
        published_at=1000.0,
        restored_at=1012.5,
    )
    assert ledger.rollouts_lost == 0
    assert (ledger.rollouts_continued, ledger.rollouts_restarted) == (2, 2)
    # 4 + 0 calls of the restarted rows, 1 held response of a continued one; the finished row counts nothing.
    assert ledger.model_calls_repeated == 5
    assert ledger.model_calls_repeated_by == {"restarted": 4, "held": 1}
    assert ledger.model_calls_cut == 2  # one running call of a continued row, one of a restarted row
    assert ledger.since_checkpoint_s == 12.5
    assert ledger.lengths == {
        "continued": {"count": 2, "min": 1, "median": 2.0, "max": 3},
        "restarted": {"count": 2, "min": 0, "median": 2.0, "max": 4},
    }
    # No resources participant reported tool calls for these rows; no participant reports tokens.
    assert ledger.tool_calls_repeated is None and ledger.tokens_regenerated is None


def test_the_tokens_regenerated_are_those_of_the_restarted_rows_calls_and_the_continued_rows_held_ones() -> None:
    rows = [
        RowState("0-0", 0, "continued", model_calls=3, held_calls=1, output_tokens=300, held_output_tokens=40),
        RowState("1-0", 0, "continued", model_calls=1, held_calls=0, output_tokens=100, held_output_tokens=0),
        RowState("2-0", 1, "restart", model_calls=4, held_calls=1, output_tokens=400, held_output_tokens=25),
        RowState("3-0", 0, "uncaptured", model_calls=0, held_calls=0, output_tokens=0, held_output_tokens=0),
        RowState("4-0", 0, "continued", model_calls=7, held_calls=2, output_tokens=700, held_output_tokens=70),
    ]
    ledger = lost_work("c", rows, continued=["0-0", "1-0"], restarted=["2-0", "3-0"], finished=["4-0"])
    # Every answered call of 2-0 (its held one among them) and 3-0, the held response of 0-0; not 4-0's.
    assert ledger.tokens_regenerated == 400 + 0 + 40
    assert ledger.model_calls_repeated == 4 + 0 + 1
    assert "(440 output tokens generated again)" in lost_work_line(ledger.to_json())
    # Model servers that reported calls but no tokens (no usage in the answers): not reported, not 0.
    untokened = [RowState(r.rollout_id, r.attempt, r.state, r.model_calls, r.held_calls) for r in rows]
    ledger = lost_work("c", untokened, continued=["0-0", "1-0"], restarted=["2-0", "3-0"], finished=["4-0"])
    assert ledger.tokens_regenerated is None and ledger.model_calls_repeated == 5
    assert "output tokens" not in lost_work_line(ledger.to_json())


def test_a_restarted_row_repeats_every_tool_call_it_had_answered() -> None:
    rows = [
        RowState("0-0", 0, "continued", tool_calls=2),
        RowState("1-0", 0, "restart", tool_calls=3),
        RowState("2-0", 0, "uncaptured", tool_calls=0),
    ]
    ledger = lost_work("c", rows, continued=["0-0"], restarted=["1-0", "2-0"])
    assert ledger.tool_calls_repeated == 3 and ledger.model_calls_repeated is None


def test_a_row_the_restore_left_out_is_lost_and_counted() -> None:
    ledger = lost_work("c", _rows(), continued=["0-0"], restarted=["2-0"], finished=["4-0"])
    assert ledger.rollouts_lost == 2  # 1-0 and 3-0: neither continued, restarted nor finished
    assert ledger.since_checkpoint_s is None


def test_without_a_model_participant_the_calls_are_not_reported() -> None:
    rows = [RowState("0-0", 0, "continued"), RowState("1-0", 0, "restart")]
    ledger = lost_work("c", rows, continued=["0-0"], restarted=["1-0"])
    assert ledger.model_calls_repeated is None and ledger.model_calls_repeated_by is None
    assert ledger.lengths == {"continued": None, "restarted": None}
    assert "model calls not reported" in lost_work_line(ledger.to_json())


def test_the_commit_replies_of_several_model_servers_add_up_and_bad_counts_are_ignored() -> None:
    counts = ledger_counts(
        {
            "model/a": {"answered_calls": {"r1": 2, "r2": 1}, "held_calls": {"r1": 1}, "running_calls": {"r2": 1}},
            "model/b": {
                "answered_calls": {"r1": 3, "r3": -1, "r4": True, "r5": "x"},
                "held_calls": {},
                "answered_output_tokens": {"r1": 30, "r2": 12},
                "held_output_tokens": {"r1": 8},
            },
            "model/c": {"answered_output_tokens": {"r1": 5}, "held_output_tokens": None},
            "environment/e": {"boundaries": {"replied": 2}},
        }
    )
    assert counts == {
        "answered_calls": {"r1": 5, "r2": 1},
        "held_calls": {"r1": 1},
        "running_calls": {"r2": 1},
        "answered_tool_calls": {},
        "answered_output_tokens": {"r1": 35, "r2": 12},
        "held_output_tokens": {"r1": 8},
    }


def test_the_row_figures_are_written_and_read_back_and_older_rows_read_without_them(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    checkpoint_id = store.checkpoint_id(1)
    write_participants_index(store.path(checkpoint_id), checkpoint_id, [])
    rows = [RowState("0-0", 0, "continued", 3, 1, 2, 4, 40, 9), RowState("1-0", 2, "restart")]
    state = CollectorState(checkpoint_id, IDENTITY, rows, timings={"published_at": 1000.0})
    store.publish(state, *store.write_records(state))
    read, _ = store.latest()
    assert read is not None and read.timings["published_at"] == 1000.0
    figures = [
        (
            r.rollout_id,
            r.model_calls,
            r.held_calls,
            r.running_calls,
            r.tool_calls,
            r.output_tokens,
            r.held_output_tokens,
        )
        for r in read.rows
    ]
    assert figures == [("0-0", 3, 1, 2, 4, 40, 9), ("1-0", None, None, None, None, None, None)]


def test_a_pause_over_its_share_of_the_interval_is_warned_about() -> None:
    record = SimpleNamespace(checkpoint_id="collect-000002-0a1b2c3d", paused_s=7.0)
    assert pause_warning(record, every=60.0, share=0.1) == (
        "checkpoint collect-000002-0a1b2c3d kept the deployment paused 7.00s, more than 0.1 of the 60s interval (6.00s)"
    )
    assert pause_warning(record, every=60.0, share=0.2) is None
    args = build_parser().parse_args(["collect", "--checkpoint-dir", "/x", "--max-pause-share", "0.25"])
    assert args.max_pause_share == 0.25
    assert build_parser().parse_args(["collect", "--checkpoint-dir", "/x"]).max_pause_share == 0.1


def test_the_summary_carries_the_ledger_beside_every_earlier_key() -> None:
    plan = RestorePlan(source="collect-000003-0a1b2c3d", continued=["0-0"], restarted=["2-0"])
    plan.lost_work = LostWork("collect-000003-0a1b2c3d", rollouts_continued=1, rollouts_restarted=1)
    outcome = SimpleNamespace(rows=4, finished=4, to_json=lambda: {"terminal_failures": [], "missing": []})
    helper = SimpleNamespace(tracker=SimpleNamespace(elsewhere=[]), done_before=2)
    checkpointer = SimpleNamespace(checkpoints=[], forgotten=0)
    drain = SimpleNamespace(to_json=lambda: None)
    summary = collect_summary("/ckpt", helper, checkpointer, plan, outcome, 1.0, drain)
    assert summary["lost_work"]["rollouts_lost"] == 0 and summary["lost_work"]["rollouts_continued"] == 1
    assert summary["continued"] == 1 and summary["restarted"] == 1 and summary["restored_from"] == plan.source
    text = " ".join(summary_table({**summary, "duplicated": [], "pause_warnings": ["x"]}).split())
    assert "lost work: 0 rows lost, 1 continued, 1 restarted" in text and "pause warnings 1" in text
    # No restore: no ledger.
    summary = collect_summary("/ckpt", helper, checkpointer, RestorePlan(), outcome, 1.0, drain)
    assert summary["lost_work"] is None
