"""``collect --resume`` sends every restart and uncaptured row as its next attempt, with token capture on.

A real deployment (every server a participant, the fake backend) with Gym's token capture on (the
local store, ``return_token_id_information: true``). Half the rows are restarts (the resources
participant declares them so when they seed); every row's second model call is held at the
backend, so at each checkpoint every row is in flight with its first call answered and captured.
Once a checkpoint holding all of them is published, the collector and every server are SIGKILLed.

Fresh servers, ``--resume``: before anything is dispatched, every restart is retired everywhere at
its checkpointed attempt (each participant counts the mark, and the environment refuses that attempt
``stale_attempt``); then the collection finishes. Each restart ran as attempt 1 (the output row says
so), and Gym's rebuild of every row's capture (``trajectories_for_rollout``, as a trainer reads it) is
unmasked with the turn's two calls: sent again as attempt 0, a restart's rows would land beside the
dead execution's (masked).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from nemo_gym.token_id_capture import TokenCaptureStore, trajectories_for_rollout

from nemo_gym_checkpoint_plugin.coordination._collector_state import CheckpointStore
from nemo_gym_checkpoint_plugin.testing.crash_scenario import RESTART_TASK_DATA
from nemo_gym_checkpoint_plugin.testing.deployment import (
    AGENT,
    BACKEND,
    DEFAULT_CHECKPOINT_BLOCK,
    ENVIRONMENT,
    MODEL,
    RESOURCES,
    TOKEN_ENV,
    Deployment,
    free_port_base,
    rollout_body,
)
from nemo_gym_checkpoint_plugin.testing.gym_config import wrapped_entrypoints
from nemo_gym_checkpoint_plugin.testing.harness import wait_until

pytestmark = pytest.mark.slow

TOKEN = "collect-capture-crash-token"
ROWS = 8
RESTARTS = {i for i in range(ROWS) if i % 2}
ENTRY = Path(__file__).with_name("collect_entry.py")
STATUS = "/ng-control/v1/checkpoint/status"
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _call(url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    )
    try:
        with _DIRECT.open(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _row(index: int) -> dict[str, Any]:
    body = rollout_body(f"row{index}")
    if index in RESTARTS:
        body["task"]["task_input"]["task_data"] = dict(RESTART_TASK_DATA)
    return {"task_id": body["task"]["task_id"], "task_input": body["task"]["task_input"]}


class Collector:
    def __init__(self, deployment: Deployment, work: Path, gym_yaml: Path, inputs: Path) -> None:
        self.deployment, self.work, self.gym_yaml, self.inputs = deployment, work, gym_yaml, inputs
        self.output = work / "out.jsonl"
        self.leg = 0

    def start(self, pause: str, resume: bool) -> tuple[subprocess.Popen[bytes], Path]:
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
            "0.3",
            *(["--resume"] if resume else []),
            f"+config_paths=[{self.gym_yaml}]",
            f"+input_jsonl_fpath={self.inputs}",
            f"+output_jsonl_fpath={self.output}",
            f"+num_samples_in_parallel={ROWS}",
            "+disable_health_check=true",
            "+environment_server_routes={example_single_tool_call: single_agent_turn}",
        ]
        log = open(self.work / f"collector-{self.leg}.log", "wb")  # noqa: SIM115 - the child keeps it
        proc = subprocess.Popen(
            argv,
            cwd=self.work,
            env={**os.environ, TOKEN_ENV: TOKEN},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return proc, events

    def log(self) -> str:
        return (self.work / f"collector-{self.leg}.log").read_text()

    def crash(self, proc: subprocess.Popen[bytes]) -> None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        self.deployment.kill()
        self.deployment.start(timeout=240)


def test_resume_sends_restarts_as_their_next_attempt_and_gym_rebuilds_every_row_unmasked(tmp_path: Path) -> None:
    captures = tmp_path / "captures"
    deployment = Deployment(
        free_port_base(),
        tmp_path,
        entrypoints=wrapped_entrypoints(),
        own_process_groups=True,
        log_dir=tmp_path / "logs",
        extra_env={TOKEN_ENV: TOKEN},
        checkpoint={**DEFAULT_CHECKPOINT_BLOCK, "step_mode": "wait"},
        model={"return_token_id_information": True},
        # rebuild_response false: the collection leaves the capture to the trainer, which rebuilds it below.
        gym_settings={
            "token_id_capture": {"enabled": True, "all_agents": True, "dir": str(captures), "rebuild_response": False}
        },
    )
    deployment.start(timeout=240)
    try:
        gym_yaml = deployment.write_config(tmp_path / "gym.yaml")
        inputs = tmp_path / "in.jsonl"
        inputs.write_text("".join(json.dumps(_row(i)) + "\n" for i in range(ROWS)))
        _scenario(Collector(deployment, tmp_path, gym_yaml, inputs), captures)
    finally:
        deployment.stop()


def _scenario(run: Collector, captures: Path) -> None:
    urls = run.deployment.urls
    # Every row's second model call (the answer after the tool call) waits at the backend.
    assert _call(urls[BACKEND] + "/_fake/hold", {"match": "(rollout row", "count": ROWS, "step": 1})[0] == 200
    proc, events = run.start("-", resume=False)
    wait_until(
        lambda: proc.poll() is not None or _call(urls[BACKEND] + "/_fake/stats?brief=true")[1]["held"] == ROWS,
        240,
        "every row's second model call held",
    )
    assert proc.poll() is None, run.log()[-3000:]
    # A checkpoint published after that holds every row, each with its first call captured.
    seen = sum(e["event"] == "published" for e in _events(events))
    wait_until(
        lambda: proc.poll() is not None or sum(e["event"] == "published" for e in _events(events)) > seen,
        240,
        "a checkpoint published with every row in flight",
    )
    run.crash(proc)
    state, _ = CheckpointStore(run.work / "ckpt").latest()
    assert state is not None
    by_row = {int(row.rollout_id.split("-")[0]): row for row in state.rows}
    assert sorted(by_row) == list(range(ROWS))
    assert {i for i, row in by_row.items() if row.state == "restart"} == RESTARTS
    assert all(row.attempt == 0 for row in by_row.values())
    for i in RESTARTS:  # what the dead execution of each restart left: its first call, under attempt 0's key
        assert len(TokenCaptureStore(captures).read_entries(f"{i}-0")) == 1, i

    # Resumed into fresh servers: the restarts are retired everywhere before anything is dispatched.
    proc, events = run.start("retired:1", resume=True)
    wait_until(
        lambda: proc.poll() is not None or any(e["event"] == "paused" for e in _events(events)),
        240,
        "the collector to retire the restarts",
    )
    assert proc.poll() is None, run.log()[-3000:]
    (retired,) = [e for e in _events(events) if e["event"] == "retired"]
    assert retired["episodes"] == {f"{i}-0": 0 for i in RESTARTS}
    for name in (ENVIRONMENT, AGENT, MODEL, RESOURCES):
        status, reply = _call(urls[name] + STATUS)
        # Each holds the restarts' marks beside the restore's marks of the continued rows.
        assert status == 200 and reply["retired_rollouts"] == ROWS, (name, reply)
    index = min(RESTARTS)
    dead = rollout_body(f"{index}-0", task_id=f"row{index}")
    dead["task"]["task_input"] = _row(index)["task_input"]
    status, reply = _call(urls[ENVIRONMENT] + "/run", dead)
    assert status == 409 and reply["error"]["code"] == "stale_attempt", reply
    for i in set(range(ROWS)) - RESTARTS:  # the restore installed each continued row's captured first call
        assert [e.rollout_id for e in TokenCaptureStore(captures).read_entries(f"{i}-0-a1")] == [f"{i}-0"], i
    (events.parent / f"{events.name}.continue").touch()
    assert proc.wait(timeout=600) == 0, run.log()[-3000:]
    summary = json.loads(run.log().strip().splitlines()[-1])
    assert summary["finished"] == ROWS and summary["missing"] == [] and summary["duplicated"] == []
    assert summary["retired_restarts"] == len(RESTARTS)
    assert summary["continued"] == ROWS - len(RESTARTS)

    output = {}
    for line in run.output.read_text().splitlines():
        record = json.loads(line)
        output[record["_ng_task_index"]] = record
    assert sorted(output) == list(range(ROWS))
    for i, record in output.items():
        # Every row ran as attempt 1: the continued ones as the restore's replacement, the restarts started over.
        assert record.get("_ng_attempt_index") == 1, (i, {k: v for k, v in record.items() if k.startswith("_ng")})
        assert record["reward"] == 1.0, i
        # What the trainer reads: Gym's rebuild of the attempt that finished.
        built = trajectories_for_rollout(f"{i}-0-a1", [captures])
        assert built is not None and built["mask_sample"] is False, (i, built)
        assert built["metrics"]["n_calls"] == 2 and not built["metrics"].get("capture_incomplete"), (i, built)
