"""Two controllers meet one deployment or one checkpoint directory: no row is lost, none is doubled.

The probes of issue 23 on real processes (the testing kit's deployment, real ``ng-checkpoint
collect`` processes, SIGKILL where a test is about a crash). In every case the output ends with
every row exactly once, or the second controller is refused before it changed anything.

The same deployment serves the collector stopped by a preemption notice (SIGTERM): its last
checkpoint is published within ``--drain-budget``, and a ``--resume`` on fresh servers loses nothing;
a second SIGTERM stops it at once, with nothing published and the deployment resumed.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from controllers_support import TOKEN, Collector, collect_deployment, fake, request, rows_of, run_row
from nemo_gym.path_utils import failures_path_for

from nemo_gym_checkpoint_plugin._storage.index import write_participants_index
from nemo_gym_checkpoint_plugin._wire import CONTROL_PREFIX
from nemo_gym_checkpoint_plugin.coordination import CoordinationError, discover
from nemo_gym_checkpoint_plugin.coordination._collector_state import CheckpointStore, CollectorState
from nemo_gym_checkpoint_plugin.testing.gym_config import BACKEND, TOKEN_ENV
from nemo_gym_checkpoint_plugin.testing.harness import wait_until, wait_until_async

ROWS = 8
NOBODY = 65534


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Any:
    deployment = collect_deployment(tmp_path_factory.mktemp("controllers"), ROWS)
    yield deployment
    deployment.stop()


@pytest.fixture
def backend(deployment: Any) -> Any:
    """The fake backend with no hold left over from another test, released again at teardown."""
    fake(deployment, "reset", {})
    yield deployment
    fake(deployment, "reset", {})


def _in_thread(call: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(reply=call()), daemon=True)
    thread.start()
    return thread, box


def _failure_rows(output: Path) -> list[dict[str, Any]]:
    sidecar = failures_path_for(output)
    return [json.loads(line) for line in sidecar.read_text().splitlines()] if sidecar.exists() else []


@pytest.mark.slow
def test_a_second_run_of_a_running_attempt_is_refused_attempt_running_and_the_first_is_unharmed(backend: Any) -> None:
    fake(backend, "hold", {"match": "(rollout row0)", "count": 1, "step": 1})
    first, box = _in_thread(lambda: run_row(backend, 0))
    wait_until(lambda: fake(backend, "stats")["held"] == 1, 60, "the first /run's model call held")
    status, reply = run_row(backend, 0)
    # Not a 200 carrying a terminal failure (what Gym makes of a plain error): a typed refusal.
    assert status == 409, reply
    assert reply["error"]["code"] == "attempt_running" and reply["error"]["episode_ids"] == ["0-0"]
    fake(backend, "release", {})
    first.join(120)
    status, result = box["reply"]
    assert status == 200 and result["failure"] is None and result["result"]["reward"] == 1.0


@pytest.mark.slow
def test_a_row_whose_attempt_lives_elsewhere_is_no_terminal_failure_and_a_resume_runs_it(
    backend: Any, tmp_path: Path
) -> None:
    ckpt, output = tmp_path / "ckpt", tmp_path / "out.jsonl"
    # Row 0's attempt runs already (another controller's /run), held at the backend.
    fake(backend, "hold", {"match": "(rollout row0)", "count": 1, "step": 1})
    other, box = _in_thread(lambda: run_row(backend, 0))
    wait_until(lambda: fake(backend, "stats")["held"] == 1, 60, "the other controller's row 0 held")
    collector = Collector(backend, tmp_path, "first", ckpt=ckpt, output=output)
    # The summary says what the output holds: row 0 is missing, an error naming it.
    assert collector.wait() == 1, collector.text()[-3000:]
    summary = collector.summary()
    assert (summary["finished"], summary["missing"], summary["lives_elsewhere"]) == (ROWS - 1, ["0-0"], ["0-0"])
    assert "1 of 8 rows are not in the output (0-0); --resume runs them" in collector.text()
    assert sorted(rows_of(output)) == list(range(1, ROWS))
    # Neither in the output nor a terminal failure in the sidecar: --resume dispatches it again.
    assert [r for r in _failure_rows(output) if r.get("_ng_task_index") == 0] == []
    fake(backend, "release", {})
    other.join(120)
    assert box["reply"][0] == 200
    resumed = Collector(backend, tmp_path, "resumed", ckpt=ckpt, output=output, resume=True)
    assert resumed.wait() == 0, resumed.text()[-3000:]
    assert rows_of(output) == {i: 1 for i in range(ROWS)}
    assert resumed.summary()["finished"] == ROWS and resumed.summary()["missing"] == []


@pytest.mark.slow
async def test_a_stale_restore_never_retires_the_replacements_another_controller_runs(
    backend: Any, tmp_path: Path
) -> None:
    ckpt = tmp_path / "old-checkpoint"
    # Row 50 (no collection here has it) in flight as attempt 0, checkpointed, then retired by its controller,
    # which runs it again as attempt 1 (held): the old checkpoint's replacement of row 50 is the running attempt.
    fake(backend, "hold", {"match": "(rollout row50)", "count": 1, "step": 1})
    first, first_box = _in_thread(lambda: run_row(backend, 50, 0))
    await wait_until_async(lambda: _held(backend, 1), 60, "row 50 attempt 0 held")
    async with await discover(backend.config, TOKEN) as coordinator:
        prepared = await coordinator.prepare("old-1", timeout=30)
        assert prepared.ready, prepared.to_json()
        await coordinator.commit("old-1", str(ckpt), prepared.continued(["50-0"]), timeout=30)
        await coordinator.resume("old-1", timeout=30)
        await coordinator.retire("old-retire", ["50-0"], timeout=30)
    await asyncio.to_thread(first.join, 120)
    assert first_box["reply"][1]["failure"]["failure_kind"] == "cancelled"
    fake(backend, "hold", {"match": "(rollout row50)", "count": 1, "step": 1})
    running, box = _in_thread(lambda: run_row(backend, 50, 1))
    await wait_until_async(lambda: _held(backend, 1), 60, "row 50 attempt 1 held")
    # A stale controller restores the old checkpoint: refused, and its clean-up leaves 50-0-a1 alone.
    async with await discover(backend.config, TOKEN) as coordinator:
        with pytest.raises(CoordinationError) as caught:
            await coordinator.restore("stale-restore", str(ckpt), ["50-0"], timeout=30)
    assert "50-0-a1" not in caught.value.result["retired"], caught.value
    fake(backend, "release", {})
    await asyncio.to_thread(running.join, 120)
    status, reply = box["reply"]
    assert status == 200 and reply["failure"] is None and reply["result"]["reward"] == 1.0, reply
    # Row 50's retired attempt 0 is this test's own mark: gone, so the module's later collections find
    # no leftover marks (which `collect` rightly refuses).
    async with await discover(backend.config, TOKEN) as coordinator:
        await coordinator.forget("forget-row50", ["50-0"], timeout=30)


async def _held(deployment: Any, count: int) -> bool:
    return (await asyncio.to_thread(fake, deployment, "stats"))["held"] >= count


@pytest.mark.slow
def test_the_same_collect_started_twice_refuses_the_second_at_once_naming_the_first(
    backend: Any, tmp_path: Path
) -> None:
    ckpt, output = tmp_path / "ckpt", tmp_path / "out.jsonl"
    fake(backend, "hold", {"match": "(rollout row", "count": ROWS, "step": 1})  # the first stays busy
    # No checkpoint published yet (every 60 s): nothing but the lock tells the second one the directory is taken.
    first = Collector(backend, tmp_path, "first", ckpt=ckpt, output=output, every=60)
    wait_until(
        lambda: fake(backend, "stats")["held"] or first.proc.poll() is not None,
        120,
        "the first collector's rows in flight",
    )
    second = Collector(backend, tmp_path, "second", ckpt=ckpt, output=output, every=60)
    assert second.wait(120) == 2, second.text()[-3000:]
    assert "is in use: collector collect-" in second.text() and f"(pid {first.proc.pid} on host " in second.text()
    assert first.proc.poll() is None
    fake(backend, "release", {})
    assert first.wait() == 0, first.text()[-3000:]
    assert rows_of(output) == {i: 1 for i in range(ROWS)} and first.summary()["finished"] == ROWS


@pytest.mark.slow
def test_two_resumes_at_once_after_a_crash_one_is_refused_and_every_row_is_once(backend: Any, tmp_path: Path) -> None:
    ckpt, output = tmp_path / "ckpt", tmp_path / "out.jsonl"
    fake(backend, "hold", {"match": "(rollout row", "count": 4, "step": 1})
    crashed = Collector(backend, tmp_path, "crashed", ckpt=ckpt, output=output, every=0.3, pause="published:1")
    wait_until(
        lambda: crashed.events_named("paused") or crashed.proc.poll() is not None,
        240,
        "a published checkpoint holding rows in flight",
    )
    assert crashed.proc.poll() is None, crashed.text()[-3000:]
    crashed.kill()
    backend.kill()
    backend.start(timeout=240)
    # Both resumes run while a row's model call is held, so neither can finish before the other starts.
    fake(backend, "hold", {"match": "(rollout row", "count": ROWS, "step": 1})
    resumes = [Collector(backend, tmp_path, f"resume-{n}", ckpt=ckpt, output=output, resume=True) for n in (1, 2)]
    wait_until(lambda: any(r.proc.poll() is not None for r in resumes), 120, "one of the resumes to end")
    (loser,) = [r for r in resumes if r.proc.poll() is not None]
    (winner,) = [r for r in resumes if r is not loser]
    assert loser.proc.returncode == 2 and "is in use: collector collect-" in loser.text(), loser.text()[-3000:]
    assert not loser.events_named("restored") and not loser.events_named("prepare")  # it changed nothing
    fake(backend, "release", {})
    assert winner.wait() == 0, winner.text()[-3000:]
    # The SIGKILLed collector's lock was stale: taken over, and said so.
    assert "which is gone" in winner.text() and winner.summary()["restored_from"] is not None
    assert rows_of(output) == {i: 1 for i in range(ROWS)}


def _cli(deployment: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nemo_gym_checkpoint_plugin.cli", *args, "--config", str(deployment.gym_yaml)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, TOKEN_ENV: TOKEN, "COLUMNS": "200"},
    )


@pytest.mark.slow
def test_a_cli_prepare_during_a_collection_is_refused_naming_the_collector(backend: Any, tmp_path: Path) -> None:
    ckpt, output = tmp_path / "ckpt", tmp_path / "out.jsonl"
    fake(backend, "hold", {"match": "(rollout row", "count": 2, "step": 1})
    collector = Collector(backend, tmp_path, "owner", ckpt=ckpt, output=output, every=0.5)
    wait_until(
        lambda: collector.events_named("published") or collector.proc.poll() is not None,
        120,
        "a checkpoint of the running collection",
    )
    refused = _cli(backend, "prepare", "by-hand-1")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "owned by another controller (collect-" in refused.stderr and "--take-over" in refused.stderr
    # So is a second collection into another directory and output, before it restores or dispatches a row.
    other = Collector(backend, tmp_path, "other", ckpt=tmp_path / "other-ckpt", output=tmp_path / "other.jsonl")
    assert other.wait(120) == 2, other.text()[-3000:]
    assert "the deployment is owned by another controller: collect-" in other.text()
    assert not (tmp_path / "other.jsonl").exists() or rows_of(tmp_path / "other.jsonl") == {}
    # Nothing closed admission for the CLI: the collection goes on checkpointing and finishes.
    published = len(collector.events_named("published"))
    wait_until(
        lambda: len(collector.events_named("published")) > published or collector.proc.poll() is not None,
        120,
        "another checkpoint after the refused prepare",
    )
    fake(backend, "release", {})
    assert collector.wait() == 0, collector.text()[-3000:]
    assert rows_of(output) == {i: 1 for i in range(ROWS)}
    # The collector gave the deployment back when it ended: the CLI may drive it now.
    assert _cli(backend, "prepare", "by-hand-2").returncode == 0
    assert _cli(backend, "resume", "by-hand-2").returncode == 0


@pytest.mark.slow
def test_a_collector_killed_right_after_a_publish_is_resumed_against_the_live_servers(
    backend: Any, tmp_path: Path
) -> None:
    ckpt, output = tmp_path / "ckpt", tmp_path / "out.jsonl"
    fake(backend, "hold", {"match": "(rollout row", "count": 4, "step": 1})
    dead = Collector(backend, tmp_path, "dead", ckpt=ckpt, output=output, every=0.3, pause="published:1")
    wait_until(
        lambda: dead.events_named("paused") or dead.proc.poll() is not None,
        240,
        "a published checkpoint holding rows in flight",
    )
    dead.kill()  # the collector only: the servers live on, in phase committed, owned by the dead collector
    statuses = [
        request(url + CONTROL_PREFIX + "/status")[1] for url in backend.urls.values() if url != backend.urls[BACKEND]
    ]
    assert {s["phase"] for s in statuses} == {"committed"}
    fake(backend, "release", {})
    resumed = Collector(backend, tmp_path, "resumed", ckpt=ckpt, output=output, resume=True)
    assert resumed.wait(180) == 0, resumed.text()[-3000:]
    text = resumed.text()
    assert "which is gone" in text and "it is fenced for good" in text
    assert "was left open (" in text and "resuming it before this run restores or dispatches" in text
    assert rows_of(output) == {i: 1 for i in range(ROWS)}


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A real 4 MB filesystem (tmpfs), so a checkpoint directory can really fill up."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"a real full disk needs a tmpfs mount here: {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(path: Path) -> None:
    with open(path, "wb") as filler:
        try:
            while True:
                filler.write(b"\0" * 65536)
                filler.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


@pytest.mark.slow
def test_a_disk_that_filled_once_recovers_failed_attempts_go_before_the_next_writes(
    backend: Any, tmp_path: Path, small_disk: Path
) -> None:
    ckpt, output = small_disk / "ckpt", tmp_path / "out.jsonl"
    fake(backend, "hold", {"match": "(rollout row", "count": 4, "step": 1})  # rows stay in flight
    collector = Collector(backend, tmp_path, "full", ckpt=ckpt, output=output, every=0.3)

    def resumed(published: bool) -> int:
        return sum(1 for e in collector.events_named("resumed") if e["published"] is published)

    wait_until(lambda: resumed(True) or collector.proc.poll() is not None, 120, "a published checkpoint")
    _fill(small_disk / "filler")
    failed = resumed(False)
    wait_until(
        lambda: resumed(False) >= failed + 3 or collector.proc.poll() is not None,
        120,
        "three checkpoints failing on the full disk",
    )
    (small_disk / "filler").unlink()  # the disk has room again
    published = resumed(True)
    wait_until(
        lambda: resumed(True) > published or collector.proc.poll() is not None, 120, "a checkpoint published again"
    )
    # No attempt ever started beside a failed one: what they left was removed first.
    for prepare in collector.events_named("prepare"):
        assert all(is_published for _name, is_published in prepare["dir"]), prepare
    fake(backend, "release", {})
    assert collector.wait() == 0, collector.text()[-3000:]
    assert rows_of(output) == {i: 1 for i in range(ROWS)}


@pytest.mark.slow
async def test_a_restore_into_servers_that_served_episodes_is_refused_alike_before_anything_is_marked(
    backend: Any, tmp_path: Path
) -> None:
    ckpt = tmp_path / "sound-checkpoint"
    # A sound checkpoint of row 60 (no collection here has it), taken on these very servers.
    fake(backend, "hold", {"match": "(rollout row60)", "count": 1, "step": 1})
    running, box = _in_thread(lambda: run_row(backend, 60, 0))
    await wait_until_async(lambda: _held(backend, 1), 60, "row 60 held")
    async with await discover(backend.config, TOKEN) as coordinator:
        prepared = await coordinator.prepare("sound-1", timeout=30)
        await coordinator.commit("sound-1", str(ckpt), prepared.continued(["60-0"]), timeout=30)
        await coordinator.resume("sound-1", timeout=30)
        fake(backend, "release", {})
        await asyncio.to_thread(running.join, 120)
        assert box["reply"][0] == 200
        before, _ = await coordinator.status()
        with pytest.raises(CoordinationError) as caught:
            await coordinator.restore("into-live-1", str(ckpt), ["60-0"], timeout=30)
        # Every kind refuses the same way, before anything is marked or installed: never half way.
        assert set(caught.value.codes) == {p.name for p in coordinator.participants}
        assert set(caught.value.codes.values()) == {"invalid_phase"}, caught.value
        assert caught.value.result["retired"] == []
        after, _ = await coordinator.status()
    for name, status in after.items():
        assert status["phase"] == "idle" and status["retired_rollouts"] == before[name]["retired_rollouts"], name


def _give_away(path: Path) -> None:
    """Make ``path`` (and all below it) another user's, as if that user had written it."""
    for item in (path, *path.rglob("*")):
        os.chown(item, NOBODY, NOBODY, follow_symlinks=False)


@pytest.mark.slow
@pytest.mark.skipif(os.getuid() != 0, reason="another user's files need root to make")
def test_a_shared_root_is_refused_and_allowed_it_follows_no_planted_link_and_resumes_no_forged_checkpoint(
    backend: Any, tmp_path: Path
) -> None:
    scratch, output = tmp_path / "scratch", tmp_path / "out.jsonl"
    scratch.mkdir()
    os.chmod(scratch, 0o777)
    refused = Collector(backend, tmp_path, "refused", ckpt=scratch, output=output)
    assert refused.wait(120) == 2 and "is not safe" in refused.text(), refused.text()[-3000:]
    assert list(scratch.iterdir()) == []
    fake(backend, "hold", {"match": "(rollout row", "count": 4, "step": 1})
    shared = ("--allow-shared-root",)
    first = Collector(backend, tmp_path, "first", ckpt=scratch, output=output, every=0.3, extra=shared)
    wait_until(lambda: first.events_named("published") or first.proc.poll() is not None, 120, "a checkpoint")
    assert "warning: --checkpoint-dir" in first.text() and "is shared" in first.text()
    # Another user points the next checkpoints of this collector at a directory of their own.
    run = first.events_named("published")[0]["checkpoint"].split("-")[2]
    newest = max(int(path.name.split("-")[1]) for path in scratch.glob("collect-*"))
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    planted = range(newest + 1, newest + 11)
    for seq in planted:
        (scratch / f"collect-{seq:06d}-{run}").symlink_to(theirs)
    _give_away(theirs)

    def published_past_the_links() -> bool:
        return any(int(e["checkpoint"].split("-")[1]) > planted[-1] for e in first.events_named("published"))

    wait_until(lambda: published_past_the_links() or first.proc.poll() is not None, 120, "a later checkpoint")
    assert first.proc.poll() is None, first.text()[-3000:]
    first.kill()
    assert list(theirs.iterdir()) == []  # nothing was ever written through their links
    real = first.events_named("published")[-1]["checkpoint"]
    backend.kill()
    backend.start(timeout=240)
    # Another user plants a forged, self-consistent newest checkpoint that holds no row: all progress lost.
    store = CheckpointStore(scratch, run=run)
    forged = store.checkpoint_id(999999)
    write_participants_index(store.path(forged), forged, [])
    state = CollectorState(forged, store.read(store.path(real)).deployment, [])  # the very deployment
    store.publish(state, *store.write_records(state))
    _give_away(store.path(forged))
    resumed = Collector(backend, tmp_path, "resumed", ckpt=scratch, output=output, resume=True, extra=shared)
    assert resumed.wait() == 0, resumed.text()[-3000:]
    assert f"checkpoint {forged} does not verify" in resumed.text() and "belongs to another user" in resumed.text()
    summary = resumed.summary()
    assert summary["restored_from"] == real and summary["continued"] > 0
    assert rows_of(output) == {i: 1 for i in range(ROWS)}


def _phases(deployment: Any) -> set[str]:
    """The control phase of every Gym server of the deployment."""
    urls = [url for name, url in deployment.urls.items() if name != BACKEND]
    return {request(url + CONTROL_PREFIX + "/status")[1]["phase"] for url in urls}


@pytest.mark.slow
def test_a_sigterm_publishes_a_last_checkpoint_within_the_budget_and_a_resume_on_fresh_servers_loses_nothing(
    backend: Any, tmp_path: Path
) -> None:
    ckpt, output = tmp_path / "ckpt", tmp_path / "out.jsonl"
    fake(backend, "hold", {"match": "(rollout row", "count": 4, "step": 1})  # four rows stay in flight
    # No periodic checkpoint (every 60 s): the only one is the SIGTERM's.
    drained = Collector(
        backend, tmp_path, "drained", ckpt=ckpt, output=output, every=60, extra=("--drain-budget", "20")
    )
    wait_until(
        lambda: (
            (fake(backend, "stats")["held"] >= 4 and len(rows_of(output)) == ROWS - 4)
            or drained.proc.poll() is not None
        ),
        120,
        "four rows in flight, the others in the output",
    )
    assert drained.proc.poll() is None, drained.text()[-3000:]
    signalled = time.monotonic()
    drained.proc.send_signal(signal.SIGTERM)  # the collector alone, as a preemption notice reaches it
    assert drained.wait(60) == 0, drained.text()[-3000:]
    text, summary = drained.text(), drained.summary()
    (published,) = drained.events_named("published")
    assert summary["drain"]["published"] and summary["drain"]["checkpoint"] == published["checkpoint"]
    assert summary["drain"]["after_s"] < 20 and time.monotonic() - signalled < 60
    assert published["continued"] >= 4  # the rows held in flight are in it
    assert CheckpointStore(ckpt).published()[-1][1].name == published["checkpoint"]
    # The line an interrupted run prints, as what it is (no error), and the exit status 0.
    assert f"stopped on SIGTERM: checkpoint {published['checkpoint']} published " in text
    assert "rows are not in the output (" in text and "; --resume runs them" in text
    assert "ng-checkpoint collect: error" not in text
    assert rows_of(output) == {i: 1 for i in rows_of(output)} and len(rows_of(output)) == ROWS - 4

    backend.kill()  # the preempted machines are gone: fresh servers
    backend.start(timeout=240)
    resumed = Collector(backend, tmp_path, "resumed", ckpt=ckpt, output=output, resume=True)
    assert resumed.wait() == 0, resumed.text()[-3000:]
    after = resumed.summary()
    assert after["restored_from"] == published["checkpoint"] and after["continued"] == published["continued"]
    assert rows_of(output) == {i: 1 for i in range(ROWS)}


@pytest.mark.slow
def test_a_second_sigterm_stops_at_once_without_publishing_and_the_deployment_is_resumed(
    backend: Any, tmp_path: Path
) -> None:
    ckpt, output = tmp_path / "ckpt", tmp_path / "out.jsonl"
    fake(backend, "hold", {"match": "(rollout row", "count": 4, "step": 1})
    # The drain's checkpoint blocks once the deployment is prepared (collect_entry's pause), within a long budget.
    stopped = Collector(
        backend,
        tmp_path,
        "stopped",
        ckpt=ckpt,
        output=output,
        every=60,
        pause="prepared:1",
        extra=("--drain-budget", "120"),
    )
    wait_until(
        lambda: fake(backend, "stats")["held"] >= 4 or stopped.proc.poll() is not None, 120, "four rows in flight"
    )
    stopped.proc.send_signal(signal.SIGTERM)
    wait_until(
        lambda: stopped.events_named("paused") or stopped.proc.poll() is not None, 60, "the drain's prepared checkpoint"
    )
    assert stopped.proc.poll() is None, stopped.text()[-3000:]
    assert _phases(backend) == {"prepared"}
    signalled = time.monotonic()
    stopped.proc.send_signal(signal.SIGTERM)
    assert stopped.wait(60) == 1, stopped.text()[-3000:]
    assert time.monotonic() - signalled < 30  # at once, not at the budget's end
    text = stopped.text()
    assert "second SIGTERM: stopping at once, without the last checkpoint" in text
    assert (
        "stopped on SIGTERM without a last checkpoint (a second SIGTERM stopped it); nothing of it was published"
        in text
    )
    assert stopped.summary()["drain"]["published"] is False and not stopped.events_named("published")
    assert CheckpointStore(ckpt).published() == []
    assert _phases(backend) == {"idle"}  # resumed: admission open again
    # The rows it left running on the servers die with them (fresh servers for the next test).
    backend.kill()
    backend.start(timeout=240)
