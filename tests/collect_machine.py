"""Random SIGKILLs of ``ng-checkpoint collect``, of the servers or of both, each followed by ``--resume``.

``tests/test_collect_crash.py`` kills one collection of 200 rows at four fixed points. This machine
(a hypothesis rule-based state machine, run one sequence per seed by ``seeded_machines``) draws a
collection of 8 to 32 rows (every fourth a restart), starts it, and at random kills: the collector, the
deployment's servers (fresh ones started on the same ports), or both, at a random moment (after some
rows are out, or paused at the collector's own events: a prepare, a prepared checkpoint, its records
written before the manifest, a publish), then resumes with ``--resume`` (itself maybe killed again).
``finish`` resumes until the collection ends (exit 0): the output holds every row exactly once, with
the rewards and outputs of an uninterrupted collection of the same rows on the same deployment.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from nemo_gym_checkpoint_plugin.testing.crash_scenario import RESTART_TASK_DATA, new_deployment
from nemo_gym_checkpoint_plugin.testing.deployment import GYM_SERVERS, ChildProcess, Deployment, spawn
from nemo_gym_checkpoint_plugin.testing.gym_config import TOKEN_ENV, rollout_body
from nemo_gym_checkpoint_plugin.testing.harness import FakeBackend, wait_until

TOKEN = "collect-machine-token"
ENTRY = Path(__file__).with_name("collect_entry.py")
PAUSES = ["-", "-", "prepare:1", "prepared:1", "records:1", "published:1", "published:2"]
LEG_SECONDS = 300.0


def new_collect_deployment(work: Path) -> Deployment:
    return new_deployment(work, TOKEN)


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def output_rows(path: Path) -> dict[int, dict[str, Any]]:
    """Index -> record; a row twice is a violation."""
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        assert record["_ng_task_index"] not in rows, f"row {record['_ng_task_index']} is in the output twice"
        rows[record["_ng_task_index"]] = record
    return rows


def comparable(record: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    """The reward and the response's output items without their ``id`` (Gym draws one per run)."""
    return record["reward"], [{k: v for k, v in item.items() if k != "id"} for item in record["response"]["output"]]


class CollectMachine(RuleBasedStateMachine):
    """One collection on ``CollectMachine.deployment`` (started by the caller), killed and resumed at random."""

    deployment: Deployment
    work: Path
    sequence = 0
    baselines: dict[int, dict[int, Any]] = {}
    WEIGHTS = {"crash": 3.0}

    def __init__(self) -> None:
        super().__init__()
        CollectMachine.sequence += 1
        self.dir = self.work / f"collect{CollectMachine.sequence}"
        self.dir.mkdir(parents=True)
        self.rows = 0
        self.leg = 0
        self.proc: ChildProcess | None = None
        self.events: Path | None = None
        self.pause = "-"
        self.complete = False
        self.exits: list[int | None] = []

    # -- a leg of the collection ---------------------------------------------------------------------

    def inputs(self, rows: int) -> Path:
        path = self.work / f"in-{rows}.jsonl"
        if not path.exists():
            lines = []
            for i in range(rows):
                body = rollout_body(f"row{i}")
                if i % 4 == 3:  # a restart: the resources participant cannot capture it
                    body["task"]["task_input"]["task_data"] = dict(RESTART_TASK_DATA)
                lines.append(json.dumps({"task_id": body["task"]["task_id"], "task_input": body["task"]["task_input"]}))
            path.write_text("".join(line + "\n" for line in lines))
        return path

    def start_leg(self, work: Path, rows: int, pause: str, resume: bool) -> tuple[ChildProcess, Path]:
        self.leg += 1
        gym_yaml = self.deployment.write_config(self.work / "gym.yaml")
        log = work / f"collector-{self.leg}.log"
        event_log = work / f"events-{self.leg}.jsonl"
        argv = [
            sys.executable,
            str(ENTRY),
            str(event_log),
            pause,
            "--",
            "--json",
            "--checkpoint-dir",
            str(work / "ckpt"),
            "--checkpoint-every",
            "0.3",
            *(["--resume"] if resume else []),
            f"+config_paths=[{gym_yaml}]",
            f"+input_jsonl_fpath={self.inputs(rows)}",
            f"+output_jsonl_fpath={work / 'out.jsonl'}",
            "+num_samples_in_parallel=6",
            "+disable_health_check=true",
            "+environment_server_routes={example_single_tool_call: single_agent_turn}",
        ]
        with open(log, "wb") as out:
            proc = spawn(
                argv,
                cwd=work,
                env={**os.environ, TOKEN_ENV: TOKEN},
                stdout=out.fileno(),
                stderr=out.fileno(),
                start_new_session=True,
            )
        return proc, event_log

    def log_tail(self) -> str:
        return (self.dir / f"collector-{self.leg}.log").read_text(errors="replace")[-3000:]

    def fresh_servers(self) -> None:
        self.deployment.kill(only=GYM_SERVERS)
        self.deployment.start(timeout=120)

    @precondition(lambda self: self.rows == 0)
    @rule(rows=st.sampled_from([8, 16, 24, 32]), pause=st.sampled_from(PAUSES))
    def begin(self, rows: int, pause: str) -> None:
        self.fresh_servers()  # a deployment that served nothing: no marks a collector did not make
        import asyncio

        asyncio.run(FakeBackend(self.deployment.urls["fake_backend"]).reset())
        self.rows, self.pause = rows, pause
        self.proc, self.events = self.start_leg(self.dir, rows, pause, resume=False)

    @precondition(lambda self: self.rows and self.proc is None and not self.complete)
    @rule(pause=st.sampled_from(PAUSES))
    def resume_collection(self, pause: str) -> None:
        self.pause = pause
        self.proc, self.events = self.start_leg(self.dir, self.rows, pause, resume=True)

    @precondition(lambda self: self.proc is not None)
    @rule(victim=st.sampled_from(["collector", "collector", "servers", "both"]), fraction=st.sampled_from([0, 1, 2, 3]))
    def crash(self, victim: str, fraction: int) -> None:
        """Kill at the leg's pause point, or (none set) once some rows are out; the leg ends either way."""
        proc, event_log = self.proc, self.events
        assert proc is not None and event_log is not None
        output = self.dir / "out.jsonl"
        written = len(output_rows(output))
        want = written + max(1, self.rows * fraction // 8)

        def reached() -> bool:
            if proc.poll() is not None:
                return True
            if self.pause != "-":
                return any(e["event"] == "paused" for e in events(event_log))
            return len(output_rows(output)) >= min(want, self.rows)

        wait_until(reached, LEG_SECONDS, f"leg {self.leg} at {self.pause} ({want} rows)")
        if victim in ("collector", "both") and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if victim in ("servers", "both"):
            self.fresh_servers()
            Path(f"{event_log}.continue").touch()  # a paused collector goes on into the dead deployment
        self.end_leg()

    def end_leg(self) -> None:
        proc = self.proc
        assert proc is not None
        try:
            code = proc.wait(timeout=LEG_SECONDS)
        except Exception:  # noqa: BLE001 - a hung collector is a violation, killed first
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            raise AssertionError(
                f"collector leg {self.leg} did not end within {LEG_SECONDS}s: {self.log_tail()}"
            ) from None
        self.exits.append(code)
        self.proc = None
        assert code in (0, 1, -signal.SIGKILL), f"leg {self.leg} exited {code}: {self.log_tail()}"
        if code == 0:
            self.complete = True
        # Whatever happened, a row is never in the output twice.
        output_rows(self.dir / "out.jsonl")

    @precondition(lambda self: self.proc is not None)
    @rule()
    def let_it_run(self) -> None:
        """No crash this leg: it goes on past any pause to its end (exit 0), or to a failure (a --resume follows)."""
        assert self.events is not None
        Path(f"{self.events}.continue").touch()
        self.end_leg()

    # -- the end -------------------------------------------------------------------------------------

    def finish(self) -> None:
        if not self.rows:
            return
        if self.proc is not None:
            Path(f"{self.events}.continue").touch()
            self.end_leg()
        for _ in range(3):
            if self.complete:
                break
            self.pause = "-"
            self.proc, self.events = self.start_leg(self.dir, self.rows, "-", resume=True)
            self.end_leg()
        assert self.complete, f"the collection never ended: exits {self.exits}: {self.log_tail()}"
        got = output_rows(self.dir / "out.jsonl")
        assert sorted(got) == list(range(self.rows)), f"rows missing: {sorted(set(range(self.rows)) - set(got))}"
        expected = self.baseline(self.rows)
        for index, record in got.items():
            assert comparable(record) == expected[index], f"row {index} differs from the uninterrupted run"

    def baseline(self, rows: int) -> dict[int, Any]:
        if rows not in CollectMachine.baselines:
            work = self.work / f"baseline-{rows}"
            work.mkdir()
            self.fresh_servers()
            proc, _ = self.start_leg(work, rows, "-", resume=False)
            assert proc.wait(timeout=LEG_SECONDS) == 0, (work / f"collector-{self.leg}.log").read_text()[-3000:]
            CollectMachine.baselines[rows] = {i: comparable(r) for i, r in output_rows(work / "out.jsonl").items()}
        return CollectMachine.baselines[rows]

    def teardown(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
