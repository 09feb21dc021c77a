"""End to end on a real Gym deployment: checkpoint rollouts in flight, SIGKILL every process group, restore, finish.

Real processes from the nemo-gym wheel (every server wrapped, checkpointing on), the fake
backend holding model calls so rollouts are in flight, the coordination library as the
controller. The scenario itself is ``crash_scenario.run_scenario`` (also ``make demo``);
these tests assert what the servers counted, not what the controller believes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from nemo_gym_checkpoint_plugin.testing.crash_scenario import ScenarioResult, new_deployment, run_scenario

pytestmark = pytest.mark.slow

TOKEN = "e2e-token"
CONTINUED = [f"cont-{i}" for i in range(4)]
RESTARTS = [f"rest-{i}" for i in range(2)]


def _scenario(tmp_path: Path, step_mode: str) -> ScenarioResult:
    deployment = new_deployment(tmp_path, TOKEN, step_mode=step_mode)
    deployment.start()
    try:
        return asyncio.run(
            run_scenario(deployment, tmp_path / "ckpt", TOKEN, CONTINUED, RESTARTS, step_mode=step_mode, timeout=90)
        )
    finally:
        deployment.stop()


def _assert_every_rollout_finished_with_reward_1(result: ScenarioResult) -> None:
    for rollout, reply in result.replies.items():
        assert reply["failure"] is None, (rollout, reply["failure"])
        assert reply["episode_id"] == {"rollout_id": rollout, "attempt": 1}
        assert reply["result"]["reward"] == 1.0, rollout
    summary = result.summary()
    assert summary["finished"] == summary["rollouts"] == len(CONTINUED) + len(RESTARTS)
    assert summary["lost"] == 0


def _tool_outputs(reply: dict) -> list[str]:
    return [item["output"] for item in reply["result"]["response"]["output"] if item["type"] == "function_call_output"]


def test_wait_mode_continued_rollouts_resume_from_their_boundary_after_sigkill(tmp_path: Path) -> None:
    result = _scenario(tmp_path, "wait")

    # Prepare waited for the continued rollouts' steps in flight; restarts never blocked.
    assert result.blocked_before_release == len(CONTINUED)
    assert result.prepare["ready"] is True and result.prepare["restarts"] == RESTARTS
    # Every continued rollout was parked after its agent step, and only those were written.
    assert result.commit_boundaries == {"replied": len(CONTINUED)}
    assert result.restored == [f"{r}-a1" for r in CONTINUED]
    assert result.continued == CONTINUED and result.restarted == RESTARTS
    _assert_every_rollout_finished_with_reward_1(result)

    # Before the crash every rollout seeded once; after it, only the restarts seeded again.
    assert result.seeds_before == dict.fromkeys(CONTINUED + RESTARTS, 1)
    assert result.seeds_after == dict.fromkeys(RESTARTS, 1)
    # Continued rollouts made no model call at all after the crash (they resumed at "replied").
    for rollout in CONTINUED:
        assert result.conversation(rollout) not in result.calls_after
    for rollout in RESTARTS:
        assert result.completed_after[result.conversation(rollout)] == {"0": 1, "1": 1}
    assert result.summary()["repeated_steps"] == 0


def test_replay_mode_restores_open_agent_sessions_and_reruns_only_the_step_in_flight(tmp_path: Path) -> None:
    result = _scenario(tmp_path, "replay")

    # Nothing blocked: the agent step in flight is dropped and run again after the crash.
    assert result.blocked_before_release == 0
    assert result.commit_boundaries == {"seeded": len(CONTINUED)}
    _assert_every_rollout_finished_with_reward_1(result)
    # The seed step did not run again: the restored attempt reused its resources session...
    assert result.seeds_after == dict.fromkeys(RESTARTS, 1)
    # ...and its agent session (restored by the agent participant), whose tool access now names the
    # replacement attempt: the tool call reached the resources server instead of being refused.
    for rollout in CONTINUED:
        assert result.completed_after[result.conversation(rollout)] == {"0": 1, "1": 1}
        assert _tool_outputs(result.replies[rollout]) == ['{"city":"San Francisco","weather_description":'
                                                          '"The weather in San Francisco is cold."}']
    # Replay reruns the step in flight: its model call that had completed before the crash repeats.
    assert result.summary()["repeated_steps"] == len(CONTINUED)
