"""``ng-checkpoint collect`` survives SIGKILLs of the whole deployment and of the collector.

One real deployment (the testing kit's, every server a participant, the fake backend), one
collection of 200 rows. An uninterrupted run gives the baseline; then one collection is
SIGKILLed (collector and every server) at each of: mid-dispatch, during a prepare (prepared,
admission closed), between the collector's records and its manifest, right after a publish;
each time fresh servers start and ``--resume`` continues it (once past a damaged newest checkpoint, to
the one before). The output holds every row exactly
once with the baseline's rewards and outputs, and no step a continued row had completed before
its checkpoint runs again (counted at the servers: seeds at resources, completed model calls at
the backend). Every fourth row is a restart: each resume retires the restarts and uncaptured rows of
its checkpoint and sends them as their next attempt (the output row's attempt is past every one
retired). A checkpoint directory of another deployment is refused before anything runs.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_checkpoint_plugin._storage.index import write_participants_index
from nemo_gym_checkpoint_plugin.coordination._collector_state import CheckpointStore, CollectorState, RowState
from nemo_gym_checkpoint_plugin.testing.crash_scenario import RESTART_TASK_DATA, new_deployment
from nemo_gym_checkpoint_plugin.testing.deployment import ChildProcess, spawn
from nemo_gym_checkpoint_plugin.testing.gym_config import BACKEND, RESOURCES, TOKEN_ENV, rollout_body
from nemo_gym_checkpoint_plugin.testing.harness import wait_until

ROWS = 200
TOKEN = "collect-crash-token"
ENTRY = Path(__file__).with_name("collect_entry.py")
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Any:
    work = tmp_path_factory.mktemp("collect-crash")
    deployment = new_deployment(work, TOKEN)
    deployment.start(timeout=240)
    deployment.gym_yaml = deployment.write_config(work / "gym.yaml")
    rows = []
    for i in range(ROWS):
        body = rollout_body(f"row{i}")
        if i % 4 == 3:  # a restart: the resources participant cannot capture it (declared when it seeds)
            body["task"]["task_input"]["task_data"] = dict(RESTART_TASK_DATA)
        rows.append({"task_id": body["task"]["task_id"], "task_input": body["task"]["task_input"]})
    deployment.inputs = work / "in.jsonl"
    deployment.inputs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    yield deployment
    deployment.stop()


def _get(url: str) -> dict[str, Any]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    with _DIRECT.open(request, timeout=30) as reply:
        return json.loads(reply.read())


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


class Run:
    def __init__(self, deployment: Any, work: Path) -> None:
        self.deployment, self.work = deployment, work
        self.output = work / "out.jsonl"
        self.leg = 0

    def start(self, pause: str, resume: bool, every: float = 0.3) -> tuple[ChildProcess, Path]:
        # Checkpoints close together: rows in flight at one are mostly still in flight at the next kill.
        self.leg += 1
        events = self.work / f"events-{self.leg}.jsonl"
        argv = [
            sys.executable,
            str(ENTRY),
            str(events),
            pause,
            "--",
            "--json",
            "--checkpoint-dir",
            str(self.work / "ckpt"),
            "--checkpoint-every",
            str(every),
            *(["--resume"] if resume else []),
            f"+config_paths=[{self.deployment.gym_yaml}]",
            f"+input_jsonl_fpath={self.deployment.inputs}",
            f"+output_jsonl_fpath={self.output}",
            "+num_samples_in_parallel=12",
            "+disable_health_check=true",
            "+environment_server_routes={example_single_tool_call: single_agent_turn}",
        ]
        with open(self.work / f"collector-{self.leg}.log", "wb") as log:
            proc = spawn(
                argv,
                cwd=self.work,
                env={**os.environ, TOKEN_ENV: TOKEN},
                stdout=log.fileno(),
                stderr=log.fileno(),
                start_new_session=True,
            )
        return proc, events

    def repeated_steps(self, events: Path) -> tuple[int, int]:
        """(continued rows of this leg's restore, steps of theirs completed before it that ran again)."""
        restored = [e for e in _events(events) if e["event"] == "restored"]
        if not restored:
            return 0, 0
        boundaries = restored[0]["boundaries"]
        completed = _get(self.deployment.urls[BACKEND] + "/_fake/stats")["completed"]
        seeds = _get(self.deployment.urls[RESOURCES] + "/ng-control/v1/checkpoint/status")["seed_sessions_by_rollout"]
        repeated = 0
        for rollout in restored[0]["continued"]:
            boundary = boundaries[rollout]
            conversation = f"what's it like in sf? (rollout row{rollout.split('-')[0]})"
            if boundary in ("seeded", "replied", "verified"):
                repeated += seeds.get(rollout, 0)
            if boundary in ("replied", "verified"):
                repeated += sum(completed.get(conversation, {}).values())
        return len(restored[0]["continued"]), repeated

    def crash(self, proc: ChildProcess) -> None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        self.deployment.kill()
        self.deployment.start(timeout=240)


def _by_row(path: Path) -> dict[int, dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        assert record["_ng_task_index"] not in rows, f"row {record['_ng_task_index']} is in the output twice"
        rows[record["_ng_task_index"]] = record
    return rows


def _output(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The response's output items without their ``id`` (Gym draws a fresh message id on every run)."""
    return [{k: v for k, v in item.items() if k != "id"} for item in record["response"]["output"]]


def _paused_or_exited(proc: ChildProcess, events: Path) -> Any:
    return lambda: proc.poll() is not None or any(e["event"] == "paused" for e in _events(events))


@pytest.mark.slow
def test_a_collection_killed_at_every_point_ends_with_each_row_once_as_uninterrupted(
    deployment: Any, tmp_path: Path
) -> None:
    baseline = Run(deployment, tmp_path / "baseline")
    baseline.work.mkdir()
    proc, _ = baseline.start("-", resume=False, every=2.0)
    assert proc.wait(timeout=600) == 0, (baseline.work / "collector-1.log").read_text()[-3000:]
    expected = _by_row(baseline.output)
    assert sorted(expected) == list(range(ROWS))

    run = Run(deployment, tmp_path / "crashed")
    run.work.mkdir()
    # Mid-dispatch: rows in flight, a checkpoint published, killed at no particular step.
    proc, events = run.start("-", resume=False)
    wait_until(
        lambda: (
            proc.poll() is not None
            or (any(e["event"] == "published" for e in _events(events)) and _lines(run.output) >= 20)
        ),
        240,
        "a published checkpoint and 20 rows done",
    )
    assert proc.poll() is None, "the collection ended before it could be killed"
    run.crash(proc)
    continued = repeated = 0
    unpublished = damaged = None
    retired: list[dict[str, int]] = []  # each leg's restarts and uncaptured rows retired before dispatch
    # During a prepare; between the collector's records and its manifest; right after a publish.
    for pause in ("prepared:2", "records:2", "published:2"):
        if pause.startswith("published"):
            # The newest published checkpoint is damaged (a byte of a records file): the one before is used.
            damaged = CheckpointStore(run.work / "ckpt").published()[-1][1]
            (records,) = (damaged / "gym" / "environment" / "single_agent_turn").glob("records-*")
            if records.stat().st_size == 0:  # no episode held there: damage the participants index instead
                records = damaged / "gym" / "participants.json"
            data = bytearray(records.read_bytes())
            data[len(data) // 2] ^= 0x01
            records.write_bytes(bytes(data))
        proc, events = run.start(pause, resume=True)
        wait_until(_paused_or_exited(proc, events), 240, f"the collector to pause at {pause}")
        log = (run.work / f"collector-{run.leg}.log").read_text()
        assert proc.poll() is None, log[-3000:]
        if unpublished is not None:  # the checkpoint whose manifest never came is never restored
            assert f"from {unpublished} " not in log and "restored " in log
            unpublished = None
        if pause.startswith("records"):
            unpublished = [e for e in _events(events) if e["event"] == "records"][-1]["checkpoint"]
        if damaged is not None:
            assert f"checkpoint {damaged.name} does not verify" in log and "falling back to the one before" in log
            assert f"from {damaged.name} " not in log
        leg_continued, leg_repeated = run.repeated_steps(events)
        continued, repeated = continued + leg_continued, repeated + leg_repeated
        retired += [e["episodes"] for e in _events(events) if e["event"] == "retired"]
        run.crash(proc)
    # Killed right after publishing a checkpoint holding rows in flight (the deployment still paused):
    # every one of them continues from it now.
    held = [e for e in _events(events) if e["event"] == "published"][-1]
    proc, events = run.start("-", resume=True)
    assert proc.wait(timeout=600) == 0, (run.work / f"collector-{run.leg}.log").read_text()[-3000:]
    leg_continued, leg_repeated = run.repeated_steps(events)
    assert leg_continued == held["continued"] > 0
    continued, repeated = continued + leg_continued, repeated + leg_repeated
    summary = json.loads((run.work / f"collector-{run.leg}.log").read_text().strip().splitlines()[-1])
    assert summary["restored_from"] == held["checkpoint"] and summary["continued"] == held["continued"]
    last = [e["episodes"] for e in _events(events) if e["event"] == "retired"]
    assert summary["retired_restarts"] == sum(len(r) for r in last)
    retired += last

    got = _by_row(run.output)
    assert sorted(got) == list(range(ROWS))
    for index, record in got.items():
        want = expected[index]
        assert record["reward"] == want["reward"], index
        assert _output(record) == _output(want), index
    assert repeated == 0, f"{repeated} steps of {continued} continued rows ran twice"
    # Every restart or uncaptured row a resume retired ran again as a later attempt, never the same one.
    assert sum(len(r) for r in retired) > 0, "no leg retired a restart"
    for episodes in retired:
        for rollout, attempt in episodes.items():
            record = got[int(rollout.split("-")[0])]
            assert record.get("_ng_attempt_index", 0) > attempt, (rollout, attempt, record.get("_ng_attempt_index"))
    assert summary["finished"] == ROWS and summary["rollouts"] == ROWS


@pytest.mark.slow
def test_a_checkpoint_dir_of_another_deployment_is_refused_before_anything_runs(
    deployment: Any, tmp_path: Path
) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    checkpoint_id = store.checkpoint_id(1)
    write_participants_index(store.path(checkpoint_id), checkpoint_id, [])
    state = CollectorState(
        checkpoint_id,
        {"participants": ["environment/elsewhere"], "output": str(tmp_path / "o")},
        [RowState("0-0", 0, "continued")],
    )
    store.publish(state, *store.write_records(state))
    run = Run(deployment, tmp_path)
    proc, events = run.start("-", resume=True)
    status = proc.wait(timeout=300)
    log = (tmp_path / "collector-1.log").read_text()
    assert status == 2, log[-3000:]
    assert "holds checkpoints of another deployment" in log and "environment/elsewhere" in log
    assert not run.output.exists() and _events(events) == []  # nothing restored, nothing collected
