"""Real collectors and a real deployment for the tests of two controllers meeting (tests/test_collect_*).

``collect_deployment`` starts the testing kit's deployment (every server a participant, the fake
backend) with a Gym config and an input file of ``rows`` rows; ``Collector`` is one
``ng-checkpoint collect`` process (through ``collect_entry.py``, which logs every checkpointer event
and can pause at one), in its own process group, killed by the test or at teardown.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from nemo_gym_checkpoint_plugin.testing.crash_scenario import new_deployment
from nemo_gym_checkpoint_plugin.testing.deployment import spawn
from nemo_gym_checkpoint_plugin.testing.gym_config import BACKEND, ENVIRONMENT, TOKEN_ENV, rollout_body

TOKEN = "controllers-token"
ENTRY = Path(__file__).with_name("collect_entry.py")
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def collect_deployment(work: Path, rows: int) -> Any:
    """A started deployment with ``gym_yaml`` and ``inputs`` (``rows`` rows) beside it."""
    deployment = new_deployment(work, TOKEN)
    deployment.start(timeout=240)
    deployment.gym_yaml = deployment.write_config(work / "gym.yaml")
    lines = []
    for i in range(rows):
        body = rollout_body(f"row{i}")
        lines.append(json.dumps({"task_id": body["task"]["task_id"], "task_input": body["task"]["task_input"]}))
    deployment.inputs = work / "in.jsonl"
    deployment.inputs.write_text("\n".join(lines) + "\n")
    deployment.rows = rows
    return deployment


def request(
    url: str, body: dict[str, Any] | None = None, *, token: str | None = TOKEN, timeout: float = 60
) -> tuple[int, dict[str, Any]]:
    """(status, JSON reply) of a GET (no body) or POST, refusals included."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    call = urllib.request.Request(url, data=data, headers=headers)
    try:
        with _DIRECT.open(call, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def fake(deployment: Any, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """A call to the fake backend's test routes (``hold``, ``release``, ``reset``, ``stats``)."""
    return request(deployment.urls[BACKEND] + f"/_fake/{route}", body, token=None)[1]


def run_row(deployment: Any, index: int, attempt: int = 0) -> tuple[int, dict[str, Any]]:
    """``/run`` of input row ``index`` straight at the environment, as Gym's collection names it."""
    body = rollout_body(f"{index}-0", attempt=attempt, prompt=f"what's it like in sf? (rollout row{index})")
    return request(deployment.urls[ENVIRONMENT] + "/run", body, token=None, timeout=300)


def rows_of(output: Path) -> Counter[int]:
    """How many times each input row (task index) is in an output file."""
    counts: Counter[int] = Counter()
    if output.exists():
        for line in output.read_text().splitlines():
            if line.strip():
                counts[json.loads(line)["_ng_task_index"]] += 1
    return counts


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Collector:
    """One ``ng-checkpoint collect`` (through collect_entry.py) in its own process group."""

    def __init__(
        self,
        deployment: Any,
        work: Path,
        name: str,
        *,
        ckpt: Path,
        output: Path,
        resume: bool = False,
        every: float = 60.0,
        pause: str = "-",
        extra: tuple[str, ...] = (),
        parallel: int = 8,
        env: dict[str, str] | None = None,
    ) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.log = work / f"collect-{name}.log"
        self.events = work / f"events-{name}.jsonl"
        argv = [
            sys.executable,
            str(ENTRY),
            str(self.events),
            pause,
            "--",
            "--json",
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            str(every),
            *(["--resume"] if resume else []),
            *extra,
            f"+config_paths=[{deployment.gym_yaml}]",
            f"+input_jsonl_fpath={deployment.inputs}",
            f"+output_jsonl_fpath={output}",
            f"+num_samples_in_parallel={parallel}",
            "+disable_health_check=true",
            "+environment_server_routes={example_single_tool_call: single_agent_turn}",
        ]
        with open(self.log, "wb") as log:
            # Forked from the session's zygote where it can (Gym's libraries already imported), as servers are.
            self.proc = spawn(
                argv,
                cwd=work,
                env={**os.environ, TOKEN_ENV: TOKEN, **(env or {})},
                stdout=log.fileno(),
                stderr=log.fileno(),
                start_new_session=True,
            )

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the collector did not finish in {timeout}s:\n{self.text()[-3000:]}") from None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def summary(self) -> dict[str, Any]:
        """The ``--json`` summary (the last line that is a JSON object)."""
        for line in reversed(self.text().strip().splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError(f"no JSON summary in the collector's output:\n{self.text()[-3000:]}")

    def events_named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in events(self.events) if e["event"] == event]
