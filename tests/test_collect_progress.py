"""What ``ng-checkpoint collect`` shows: a live bar on a terminal, a line per checkpoint, a summary table."""

from __future__ import annotations

import io
from types import SimpleNamespace

from nemo_gym_checkpoint_plugin.cli._collect_progress import CollectProgress, summary_table


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _record(published: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        published=published,
        checkpoint_id="collect-000001-0a1b2c3d",
        continued=2,
        restarts=1,
        paused_s=0.5,
        prepare_s=0.25,
        commit_s=0.125,
        problem=None if published else "not ready",
    )


def test_a_terminal_gets_a_live_bar_of_rows_in_flight_and_checkpoint_age() -> None:
    stream = _Terminal()
    progress = CollectProgress(stream)
    progress.update(total=10)
    progress.start()
    progress.update(done=3, in_flight=2)
    progress.checkpoint_line(_record())
    progress.update(done=10, in_flight=0)
    progress.stop()
    shown = stream.getvalue()
    assert "10/10" in shown and "in flight 0" in shown and "last checkpoint 0s ago" in shown
    assert "paused the deployment 0.50s (prepare 0.25s, commit 0.12s)" in " ".join(shown.split())


def test_without_a_terminal_each_checkpoint_is_one_line() -> None:
    stream = io.StringIO()
    progress = CollectProgress(stream)
    progress.start()
    progress.checkpoint_line(_record())
    progress.checkpoint_line(_record(published=False))
    lines = stream.getvalue().splitlines()
    assert lines == [
        "[collect] checkpoint collect-000001-0a1b2c3d: 2 rows continued, 1 restarts; paused the deployment 0.50s "
        "(prepare 0.25s, commit 0.12s)",
        "[collect] checkpoint collect-000001-0a1b2c3d not published (not ready); paused 0.50s",
    ]


def test_the_summary_table_names_the_pauses_the_restore_and_the_fallbacks() -> None:
    text = summary_table(
        {
            "rollouts": 200,
            "finished": 200,
            "finished_before": 50,
            "continued": 9,
            "restarted": 3,
            "checkpoints": 4,
            "checkpoint_attempts": 5,
            "pause_s": {"mean": 0.5, "max": 1.25},
            "restore_s": 0.12,
            "restored_from": "collect-000008-0a1b2c3d",
            "fallbacks": [["collect-000009-0a1b2c3d", "records file digest does not match"]],
            "forgotten": 150,
            "checkpoint_dir": "/ckpt",
            "terminal_failures": ["3-0"],
            "missing": ["4-0", "5-0"],
            "duplicated": [],
        }
    )
    assert "4 of 5" in text and "mean 0.50s, max 1.25s" in text
    flat = " ".join(text.split())
    assert "failed for good 1" in flat and "missing (--resume runs them) 2" in flat
    assert "0.12s from collect-000008-0a1b2c3d" in text
    assert "collect-000009-0a1b2c3d: records file digest does not match" in " ".join(text.split())
