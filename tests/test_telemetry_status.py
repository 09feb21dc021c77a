"""The last checkpoint in ``status`` (its age, pause and size) and ``ng-checkpoint status``'s pause warning."""

from __future__ import annotations

import argparse
import time
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from control_support import Harness, close_harness, make_harness

from nemo_gym_checkpoint_plugin.cli import build_parser
from nemo_gym_checkpoint_plugin.cli._status import last_checkpoint, pause_warnings


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await make_harness(tmp_path)
    yield harness
    await close_harness(harness)


async def test_status_tells_the_last_checkpoint_once_there_is_one(h: Harness) -> None:
    assert "last_checkpoint" not in await h.status()
    h.participant.add("r1", "r2")
    started = time.time()
    reply = await h.checkpoint("c1", ["r1", "r2"])
    committed = (await h.status())["last_checkpoint"]
    assert "paused_seconds" not in committed  # admission is still closed: the pause has not ended
    await h.call("resume", checkpoint_id="c1")
    last = (await h.status())["last_checkpoint"]
    records = h.directory / "gym" / "environment" / "env_one" / reply["manifest"]["records_file"]
    assert last["checkpoint_id"] == "c1" and last["records"] == 2 and last["episodes"] == 2
    assert last["size_bytes"] == records.stat().st_size
    assert started <= last["published_at"] <= time.time()
    assert 0 < last["paused_seconds"] <= time.time() - started


async def test_a_later_checkpoint_that_never_published_keeps_the_last_one(h: Harness) -> None:
    h.participant.add("r1")
    await h.checkpoint("c1", None)
    await h.call("resume", checkpoint_id="c1")
    paused = (await h.status())["last_checkpoint"]["paused_seconds"]
    await h.call("prepare", checkpoint_id="c2")
    await h.call("resume", checkpoint_id="c2")  # a checkpoint that never published changes nothing
    last = (await h.status())["last_checkpoint"]
    assert last["checkpoint_id"] == "c1" and last["paused_seconds"] == paused


def test_the_note_reads_age_pause_and_size() -> None:
    status = {"last_checkpoint": {"published_at": 1000.0, "paused_seconds": 1.24, "size_bytes": 4_100_000}}
    assert last_checkpoint(status, now=1180.0) == "last checkpoint 3m ago, paused 1.2s, 4.1 MB"
    assert last_checkpoint({"last_checkpoint": {"published_at": 1000.0}}, now=1005.0) == "last checkpoint 5s ago"
    assert last_checkpoint({}) is None


def test_a_pause_over_its_share_of_the_interval_is_warned_about() -> None:
    statuses = {
        "model": {"last_checkpoint": {"checkpoint_id": "s-1", "paused_seconds": 31.0}},
        "agent": {"last_checkpoint": {"checkpoint_id": "s-1", "paused_seconds": 29.0}},
        "env": {},
    }
    assert pause_warnings(statuses, None, 0.1) == []
    assert pause_warnings(statuses, 300.0, 0.1) == [
        "model: checkpoint s-1 paused it 31.0s, more than 0.1 of the 300s interval (30.0s)"
    ]


def test_the_status_options_parse() -> None:
    parser = build_parser()
    args = parser.parse_args(["status", "--interval", "300", "--max-pause-share", "0.25"])
    assert isinstance(args, argparse.Namespace) and args.interval == 300 and args.max_pause_share == 0.25
    assert parser.parse_args(["status"]).max_pause_share == 0.1
    for bad in (["--max-pause-share", "0"], ["--max-pause-share", "1.5"], ["--interval", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["status", *bad])


@pytest.mark.slow
def test_ng_checkpoint_status_shows_the_last_checkpoint_and_warns(tmp_path: Path) -> None:
    from coord_support import four_participants, stop_participants
    from test_cli_live import TOKEN_ENV, cli, urls

    servers = four_participants(tmp_path)
    try:
        where = [*urls(servers), "--token-env", TOKEN_ENV]
        assert cli("prepare", "step-1", *where, "--deadline", "20").returncode == 0
        committed = cli("commit", "step-1", *where, "--dir", str(tmp_path / "ckpt"), "--episode", "r1")
        assert committed.returncode == 0, committed.stderr
        assert cli("resume", "step-1", *where).returncode == 0
        shown = cli("status", *where, "--interval", "0.001")
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.count("last checkpoint") == 4, shown.stdout
        assert shown.stderr.count("warning: ") == 4, shown.stderr
        watched = cli("status", *where, "--interval", "0.001", "--watch", "0.1", "--count", "1")
        assert watched.returncode == 0 and watched.stderr.count("warning: ") == 4, watched.stderr
        assert max(map(len, shown.stdout.splitlines())) <= 80  # the notes wrap: the table still fits
        quiet = cli("status", *where, "--interval", "100000")
        assert "warning" not in quiet.stderr
        document = orjson.loads(cli("status", *where, "--json", "--interval", "0.001").stdout)
        assert len(document["warnings"]) == 4
        assert {p["last_checkpoint"]["checkpoint_id"] for p in document["participants"]} == {"step-1"}
    finally:
        stop_participants(servers)
