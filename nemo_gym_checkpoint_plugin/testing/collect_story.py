"""``make demo``'s story: Gym's rollout collection, checkpointed, SIGKILLed with every server, resumed, compared.

On a started deployment (``crash_scenario.new_deployment``: every server a participant):

1. ``ng-checkpoint collect`` of ``rows`` rows without interruption: the reference output;
2. the same rows again, checkpointed every ``every`` seconds, with the answer after the tool call
   of a few rows past the middle held at the fake backend (so they are in flight, inside their
   agent turn, whatever the machine's speed); as soon as a published checkpoint holds those rows
   in flight, the collector and every server are SIGKILLed;
3. fresh servers; ``ng-checkpoint collect --resume`` to the end: the rows in flight at that
   checkpoint continue as their next attempt, the others come from the output or start over;
4. the outputs compared row by row (reward and response output, without Gym's random item ids),
   and the steps continued rows had completed before the checkpoint counted again at the
   servers (seeds at the resources server, completed calls at the fake backend).

With ``captures`` (Gym's capture directory of a deployment with token capture on,
``crash_scenario.new_deployment(..., token_capture=True)``), the capture invariant too: the
reference's rows are moved out of the directory before the checkpointed run (``<work>/captures-
uninterrupted``: both runs send the same rollout ids), and after the resume, for every row of the
output, Gym's own rebuild of the attempt that finished it (``trajectories_for_rollout``, as a
trainer reads it) must be unmasked and complete with one captured call per model call its turn
made (the model answers in its output, which the reference's rebuild of the row must match).

Each collector is its own process (``python -m nemo_gym_checkpoint_plugin.cli collect``), its
output in ``<work>/logs/collect-*.log``; a cancelled story kills it before returning. The
checkpoints go under ``<work>`` or, with ``checkpoint_root``, under that directory or object-store
URL (``s3://bucket/demo``; the deployment must then use the ``fsspec`` storage backend).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._identity import capture_key
from .._storage.location import Location, location
from .._storage.reader import read_checkpoint
from ..coordination._collector_state import CheckpointStore
from .deployment import BACKEND, ENVIRONMENT, RESOURCES, TOKEN_ENV, Deployment, DeploymentError, rollout_body

__all__ = ["run_collect_story"]

_POLL = 0.05
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _write_inputs(path: Path, rows: int) -> None:
    lines = []
    for index in range(rows):
        body = rollout_body(f"row{index}")
        lines.append(json.dumps({"task_id": body["task"]["task_id"], "task_input": body["task"]["task_input"]}))
    path.write_text("\n".join(lines) + "\n")


def _conversation(rollout_id: str) -> str:
    # Gym names a row's rollout "<task index>-<rollout index>"; the inputs put "row<task index>" in the prompt.
    return f"what's it like in sf? (rollout row{rollout_id.split('-')[0]})"


def _by_row(path: Path) -> tuple[dict[int, dict[str, Any]], int]:
    """Rows of an output file by task index, and how many rows appeared more than once."""
    rows: dict[int, dict[str, Any]] = {}
    repeats = 0
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            repeats += record["_ng_task_index"] in rows
            rows[record["_ng_task_index"]] = record
    return rows, repeats


def _comparable(record: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    """Reward and response output, without the ids Gym draws afresh on every run."""
    return record.get("reward"), [{k: v for k, v in item.items() if k != "id"} for item in record["response"]["output"]]


class _Collector:
    """One ``ng-checkpoint collect`` process in its own group; killed, never left behind."""

    def __init__(
        self,
        deployment: Deployment,
        work: Path,
        token: str,
        name: str,
        output: Path,
        ckpt: Location,
        every: float,
        parallel: int,
        resume: bool = False,
    ) -> None:
        self.log = work / "logs" / f"collect-{name}.log"
        argv = [
            sys.executable,
            "-m",
            "nemo_gym_checkpoint_plugin.cli",
            "collect",
            "--json",
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            str(every),
            *(["--resume"] if resume else []),
            f"+config_paths=[{work / 'gym_config.yaml'}]",
            f"+input_jsonl_fpath={work / 'in.jsonl'}",
            f"+output_jsonl_fpath={output}",
            f"+num_samples_in_parallel={parallel}",
            "+disable_health_check=true",
            f"+environment_server_routes={{{RESOURCES}: {ENVIRONMENT}}}",
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                cwd=work,
                env={**os.environ, TOKEN_ENV: token},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    async def wait(self, timeout: float) -> dict[str, Any]:
        """Its summary (the last line of its output) once it exited 0; ``RuntimeError`` otherwise."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise DeploymentError(f"the collector did not finish in {timeout}s (log: {self.log})")
            await asyncio.sleep(_POLL)  # wait-ok: poll interval of a bounded wait on a condition
        if self.proc.returncode != 0:
            raise DeploymentError(f"the collector exited with status {self.proc.returncode} (log: {self.log})")
        return json.loads(self.log.read_text().strip().splitlines()[-1])


def _get(url: str, token: str) -> dict[str, Any]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with _DIRECT.open(request, timeout=30) as reply:
        return json.loads(reply.read())


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with _DIRECT.open(request, timeout=30) as reply:
        return json.loads(reply.read())


def _held_rows(rows: int, parallel: int) -> list[int]:
    """The task indices whose second model call the checkpointed run holds: ``parallel`` rows past the middle."""
    first = max(0, min(rows - parallel, rows * 5 // 8))
    return list(range(first, min(rows, first + parallel)))


async def _held_checkpoint(store: CheckpointStore, collector: _Collector, timeout: float, held: set[str]) -> str | None:
    """Wait for a published checkpoint holding every rollout of ``held`` in flight; its id (None if none came)."""
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    while collector.proc.poll() is None and time.monotonic() < deadline:
        for _seq, path in await asyncio.to_thread(store.published):
            if path.name not in seen:
                seen.add(path.name)
                state = await asyncio.to_thread(store.read, path)
                if held <= {row.rollout_id for row in state.by_state("continued")}:
                    return path.name
        await asyncio.sleep(_POLL)  # wait-ok: poll interval of a bounded wait on a condition
    return None


def _turn_calls(record: dict[str, Any]) -> int:
    """The model calls a row's turn made: each answer of the fake backend is one message or one tool call."""
    return sum(1 for item in record["response"]["output"] if item.get("type") in ("message", "function_call"))


def _set_aside(captures: Path, into: Path) -> None:
    """Move the capture rows out of ``captures`` (Gym's lock files stay: its writers keep locking those inodes)."""
    into.mkdir(parents=True, exist_ok=True)
    for path in captures.iterdir():
        if path.is_file() and not path.name.endswith(".lock"):
            path.rename(into / path.name)


def _capture_check(captures: Path, reference_captures: Path, got: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Gym's rebuild of every output row's finished attempt: masked, incomplete or wrong call counts, by key."""
    # Here, not at the top: both load Gym's modules, which the kit imports without (and without httpx).
    from nemo_gym.token_id_capture import trajectories_for_rollout

    from ..coordination._gym_client import row_episode

    masked: list[str] = []
    wrong: dict[str, list[int]] = {}
    for index in sorted(got):
        record = got[index]
        episode = row_episode(record)
        key = capture_key(episode["rollout_id"], episode["attempt"])
        calls = _turn_calls(record)
        built = trajectories_for_rollout(key, [captures]) or {}
        reference = trajectories_for_rollout(f"{episode['rollout_id']}", [reference_captures]) or {}
        if built.get("mask_sample") is not False or built.get("metrics", {}).get("capture_incomplete"):
            masked.append(key)
        counted = [built.get("metrics", {}).get("n_calls"), reference.get("metrics", {}).get("n_calls")]
        if counted != [calls, calls]:
            wrong[key] = [calls, *counted]
    return {"rows": len(got), "masked": masked, "n_calls_wrong": wrong}


async def run_collect_story(
    deployment: Deployment,
    work: Path,
    token: str,
    rows: int,
    *,
    every: float = 2.0,
    parallel: int = 4,
    say: Callable[[str], None] = lambda _m: None,
    timeout: float = 600.0,
    checkpoint_root: str | None = None,
    captures: Path | None = None,
) -> dict[str, Any]:
    """The story of the module docstring on a started ``deployment``; the demo's summary (``capture`` too
    with ``captures``: rows checked, and the keys masked or with a wrong call count)."""
    (work / "logs").mkdir(parents=True, exist_ok=True)
    deployment.write_config(work / "gym_config.yaml")
    _write_inputs(work / "in.jsonl", rows)
    root = work if checkpoint_root is None else location(checkpoint_root)
    ckpt = root / "ckpt"
    reference_out, output = work / "uninterrupted" / "rollouts.jsonl", work / "collected" / "rollouts.jsonl"
    collectors: list[_Collector] = []

    def start(name: str, out: Path, directory: Location, resume: bool = False) -> _Collector:
        collectors.append(_Collector(deployment, work, token, name, out, directory, every, parallel, resume))
        return collectors[-1]

    try:
        say(f"collecting {rows} rows without interruption (the reference), with Gym's rollout collection")
        await start("uninterrupted", reference_out, root / "uninterrupted-ckpt").wait(timeout)
        if captures is not None:
            # Both runs send the same rollout ids: the checkpointed run's rows must not land beside these.
            _set_aside(captures, work / "captures-uninterrupted")
        hold = _held_rows(rows, parallel)
        for index in hold:
            # The row's second model call (its answer after the tool call) waits at the backend until the crash.
            _post(deployment.urls[BACKEND] + "/_fake/hold", {"match": f"(rollout row{index})", "count": 1, "step": 1})
        say(
            f"collecting them again, checkpointed every {every:g}s into {ckpt}; rows {hold[0]}-{hold[-1]} "
            f"have their last model call held at the fake backend, so they are in flight at the crash"
        )
        crashed = start("checkpointed", output, ckpt)
        held = await _held_checkpoint(CheckpointStore(ckpt), crashed, timeout, {f"{index}-0" for index in hold})
        if held is None:
            raise DeploymentError(f"no published checkpoint held rows {hold} in flight (log: {crashed.log})")
        killed = deployment.process_groups
        crashed.kill()
        deployment.kill()
        done = len(_by_row(output)[0])
        say(
            f"SIGKILLed the collector and {len(killed)} server process groups ({', '.join(sorted(killed))}) "
            f"after checkpoint {held} was published, {done} of {rows} rows done; starting fresh processes"
        )
        await asyncio.to_thread(deployment.start)
        state, _skipped = await asyncio.to_thread(CheckpointStore(ckpt).latest)
        finished = {f"{index}-0" for index in _by_row(output)[0]}
        boundaries: dict[str, Any] = {}
        if state is not None and state.path is not None:  # latest() names where it read it
            env = read_checkpoint(state.path, "environment", ENVIRONMENT).records
            boundaries = {
                r["episode_id"]["rollout_id"]: r["boundary"]
                for r in env
                if r["episode_id"]["rollout_id"] not in finished
            }
        say("resuming: ng-checkpoint collect --resume")
        summary = await start("resumed", output, ckpt, resume=True).wait(timeout)
        say(
            f"restored {summary['continued']} rows from {summary['restored_from']} in {summary['restore_s']:.2f}s; "
            f"{summary['restarted']} started over"
        )
    finally:
        for collector in collectors:
            collector.kill()
    completed = _get(deployment.urls[BACKEND] + "/_fake/stats", token)["completed"]
    seeds = _get(deployment.urls[RESOURCES] + "/ng-control/v1/checkpoint/status", token)["seed_sessions_by_rollout"]
    repeated = 0
    if summary["continued"]:
        for rollout, boundary in boundaries.items():
            if boundary in ("seeded", "replied", "verified"):
                repeated += seeds.get(rollout, 0)
            if boundary in ("replied", "verified"):
                repeated += sum(completed.get(_conversation(rollout), {}).values())
    got, twice = _by_row(output)
    reference, _ = _by_row(reference_out)
    identical = (
        twice == 0
        and set(got) == set(reference) == set(range(rows))
        and all(_comparable(got[i]) == _comparable(reference[i]) for i in got)
    )
    say(f"the output holds {len(got)} rows ({twice} twice); identical to the uninterrupted run: {identical}")
    extra: dict[str, Any] = {}
    if captures is not None:
        capture = await asyncio.to_thread(_capture_check, captures, work / "captures-uninterrupted", got)
        say(
            f"Gym's rebuild of every row's token capture: {len(capture['masked'])} masked, "
            f"{len(capture['n_calls_wrong'])} with a call count other than its turn's, of {capture['rows']}"
        )
        extra["capture"] = capture
    return {
        "rollouts": rows,
        "finished": len(got),
        "reward_1": sum(1 for record in got.values() if record.get("reward") == 1.0),
        "continued": summary["continued"],
        "restarted": summary["restarted"],
        "lost": rows - len(got),
        "repeated_steps": repeated,
        "checkpoint_dir": str(ckpt),
        "identical_to_uninterrupted": identical,
        "prepare_s": (state.timings.get("prepare_s", 0.0) if state is not None else 0.0),
        "commit_s": (state.timings.get("commit_s", 0.0) if state is not None else 0.0),
        "restore_s": summary["restore_s"],
        **extra,
    }
