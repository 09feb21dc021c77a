"""The lost-work ledger of a real crash and resume: its figures are the fake backend's counters.

A real deployment (the testing kit's, every server a participant, the fake backend) and real
``ng-checkpoint collect`` processes. Every row's second model call (step 1, after its tool call) is
held at the backend; once all of them are, the collector's first checkpoint goes on and is published
(every fourth row a restart), and the collector and every server are SIGKILLed while the checkpoint
still holds the deployment paused. Fresh servers start and ``--resume`` finishes the collection,
checkpointing while the restarted rows are held again, each pause warned about (``--max-pause-share``).

The backend counts calls per conversation and step in each of its two lives: a completed call
counted in both is one the crash made run again, a call that arrived in both one sent again; the
resources server counts tool calls per rollout the same way, and the backend the tokens it generated
per conversation. The ledger in the resumed collector's
``--json`` says the same without looking at either.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from controllers_support import Collector, collect_deployment, fake, request, rows_of

from nemo_gym_checkpoint_plugin.testing.crash_scenario import RESTART_TASK_DATA
from nemo_gym_checkpoint_plugin.testing.gym_config import RESOURCES, rollout_body
from nemo_gym_checkpoint_plugin.testing.harness import wait_until

ROWS = 8
RESTARTS = [i for i in range(ROWS) if i % 4 == 3]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Any:
    deployment = collect_deployment(tmp_path_factory.mktemp("lost-work"), ROWS)
    lines = []
    for i in range(ROWS):
        body = rollout_body(f"row{i}")
        if i in RESTARTS:  # the resources participant cannot capture it (declared when it seeds)
            body["task"]["task_input"]["task_data"] = dict(RESTART_TASK_DATA)
        lines.append(json.dumps({"task_id": body["task"]["task_id"], "task_input": body["task"]["task_input"]}))
    deployment.inputs.write_text("\n".join(lines) + "\n")
    yield deployment
    deployment.stop()


def _twice(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> int:
    """Calls (conversation, step) the backend counted in both of its lives."""
    return sum(
        min(count, after.get(conversation, {}).get(step, 0))
        for conversation, steps in before.items()
        for step, count in steps.items()
    )


def _tool_calls(deployment: Any) -> dict[str, int]:
    """The resources server's tool calls per rollout (attempts added up), from its status."""
    status, reply = request(deployment.urls[RESOURCES] + "/ng-control/v1/checkpoint/status")
    assert status == 200, reply
    return reply["tool_calls_by_rollout"]


def _paused_at(collector: Collector, point: str) -> Any:
    return lambda: (
        collector.proc.poll() is not None or any(e.get("at") == point for e in collector.events_named("paused"))
    )


@pytest.mark.slow
def test_the_ledger_of_a_crash_equals_what_the_backend_counted_twice(deployment: Any, tmp_path: Path) -> None:
    fake(deployment, "reset", {})
    ckpt, output = tmp_path / "ckpt", tmp_path / "out.jsonl"
    fake(deployment, "hold", {"match": "(rollout row", "count": ROWS, "step": 1})
    first = Collector(deployment, tmp_path, "first", ckpt=ckpt, output=output, every=0.3, pause="prepare:1,published:1")
    try:
        wait_until(_paused_at(first, "prepare:1"), 240, "the first checkpoint to begin")
        assert first.proc.poll() is None, first.text()[-3000:]
        # Every row in flight, its second model call held at the backend: then the checkpoint goes on.
        wait_until(lambda: fake(deployment, "stats")["held"] == ROWS, 120, "every row's step-1 call held")
        first.events.with_name(f"{first.events.name}.continue").touch()
        wait_until(_paused_at(first, "published:1"), 120, "the checkpoint published")
        assert first.proc.poll() is None, first.text()[-3000:]
        (published,) = first.events_named("published")
        assert published["continued"] == ROWS - len(RESTARTS)
        before = fake(deployment, "stats")
        tools_before = _tool_calls(deployment)
    finally:
        first.kill()
    # The crash: every server SIGKILLed while the checkpoint still held the deployment paused.
    deployment.kill()
    deployment.start(timeout=240)

    # The restarted rows' second calls held in the new life: the resumed collection checkpoints meanwhile,
    # each pause far over its --max-pause-share of the interval (0.01 of 0.3s).
    for i in RESTARTS:
        fake(deployment, "hold", {"match": f"(rollout row{i})", "count": 1, "step": 1})
    second = Collector(
        deployment,
        tmp_path,
        "second",
        ckpt=ckpt,
        output=output,
        resume=True,
        every=0.3,
        extra=("--max-pause-share", "0.01"),
    )
    try:
        wait_until(
            lambda: second.proc.poll() is not None or any(e["published"] for e in second.events_named("resumed")),
            240,
            "a checkpoint of the resumed collection",
        )
    finally:
        fake(deployment, "release", {})
    assert second.wait(300) == 0, second.text()[-3000:]
    after = fake(deployment, "stats")
    tools_after = _tool_calls(deployment)
    summary = second.summary()
    ledger = summary["lost_work"]
    assert rows_of(output) == {i: 1 for i in range(ROWS)}

    assert ledger["checkpoint_id"] == published["checkpoint"] == summary["restored_from"]
    assert ledger["rollouts_lost"] == 0
    assert ledger["rollouts_continued"] == summary["continued"] == ROWS - len(RESTARTS)
    assert ledger["rollouts_restarted"] == summary["restarted"] == len(RESTARTS)
    # Completed calls the backend answered in both lives: the restarted rows' first calls, nothing else.
    repeated = _twice(before["completed"], after["completed"])
    assert repeated == len(RESTARTS) > 0
    assert ledger["model_calls_repeated"] == repeated
    assert ledger["model_calls_repeated_by"] == {"restarted": len(RESTARTS), "held": 0}
    # Calls sent to the backend in both lives: those, and the step-1 call every row had running.
    assert ledger["model_calls_cut"] == _twice(before["calls"], after["calls"]) - repeated == ROWS
    # Each row had one model call answered at the checkpoint.
    assert ledger["lengths"]["continued"] == {"count": ROWS - len(RESTARTS), "min": 1, "median": 1, "max": 1}
    assert ledger["lengths"]["restarted"] == {"count": len(RESTARTS), "min": 1, "median": 1, "max": 1}
    assert 0 < ledger["since_checkpoint_s"] < 600
    # Tool calls the resources server ran in both of its lives: the restarted rows' one each.
    tools_twice = sum(min(count, tools_after.get(rollout, 0)) for rollout, count in tools_before.items())
    assert ledger["tool_calls_repeated"] == tools_twice == len(RESTARTS)
    # Output tokens: the backend counted every token it generated per conversation; in its first life each row's
    # step-0 call alone generated (the step-1 calls were held before generating), so the restarted rows' figures
    # are the tokens of the calls the crash made run again, as the answers' usage reported them.
    regenerated = {
        conversation: tokens
        for conversation, tokens in before["generated"].items()
        if any(f"(rollout row{i})" in conversation for i in RESTARTS)
    }
    assert len(regenerated) == len(RESTARTS) and all(tokens > 0 for tokens in regenerated.values()), before
    assert ledger["tokens_regenerated"] == sum(regenerated.values())
    assert f"({ledger['tokens_regenerated']} output tokens generated again)" in second.text()
    # The ledger is a line of the resumed collector's output too, and its event carries the same figures.
    assert "lost work: 0 rows lost" in second.text()
    (event,) = second.events_named("lost_work")
    assert event["ledger"] == ledger
    # The pause warning: said as it happens and listed in the summary.
    assert summary["pause_warnings"] and "more than 0.01 of the 0.3s interval" in summary["pause_warnings"][0]
    assert f"warning: {summary['pause_warnings'][0]}" in second.text()
