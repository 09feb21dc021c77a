"""End to end on a real Gym deployment: checkpoint rollouts in flight, SIGKILL every process group, restore, finish.

Real processes from the nemo-gym wheel (every server wrapped, checkpointing on), the fake
backend holding model calls so rollouts are in flight, the coordination library as the
controller. The scenario itself is ``crash_scenario.run_scenario`` (also ``make demo``);
these tests assert what the servers counted, not what the controller believes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest
from nemo_gym.token_id_capture import trajectories_for_rollout

from nemo_gym_checkpoint_plugin.testing.crash_scenario import ScenarioResult, new_deployment, run_scenario

pytestmark = pytest.mark.slow

TOKEN = "e2e-checkpoint-token"
CONTINUED = [f"cont-{i}" for i in range(4)]
RESTARTS = [f"rest-{i}" for i in range(2)]


def _scenario(
    tmp_path: Path, step_mode: str, *, incremental: bool = False, token_capture: bool = False
) -> ScenarioResult:
    capture = {"enabled": True, "all_agents": True, "dir": str(tmp_path / "captures")}
    deployment = new_deployment(
        tmp_path,
        TOKEN,
        step_mode=step_mode,
        # Gym's token capture: each model call's row in the run's capture directory, which the model server exports.
        model={"return_token_id_information": True} if token_capture else None,
        gym_settings={"token_id_capture": capture} if token_capture else None,
    )
    deployment.start()
    try:
        return asyncio.run(
            run_scenario(
                deployment,
                tmp_path / "ckpt",
                TOKEN,
                CONTINUED,
                RESTARTS,
                step_mode=step_mode,
                timeout=90,
                incremental=incremental,
            )
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


def _assert_continued_inside_their_turn(result: ScenarioResult) -> None:
    # Nothing blocked: the held model calls are still generating, and the agent captures the turn mid-way.
    assert result.blocked_before_release == 0
    assert result.prepare["ready"] is True and result.prepare["restarts"] == RESTARTS
    # Every continued rollout was written inside its agent step; only those were written.
    assert result.commit_boundaries == {"seeded": len(CONTINUED)}
    assert result.restored == [f"{r}-a1" for r in CONTINUED]
    assert result.continued == CONTINUED and result.restarted == RESTARTS
    _assert_every_rollout_finished_with_reward_1(result)

    # Before the crash every rollout seeded once; after it, only the restarts seeded again.
    assert result.seeds_before == dict.fromkeys(CONTINUED + RESTARTS, 1)
    assert result.seeds_after == dict.fromkeys(RESTARTS, 1)
    for rollout in CONTINUED:
        # The turn went on from its last boundary: its first model call and its tool call were not sent
        # again, only the call that was held at the crash; the tool output is the one recorded before it.
        assert result.completed_before[result.conversation(rollout)] == {"0": 1}
        assert result.calls_after[result.conversation(rollout)] == {"1": 1}
        assert _tool_outputs(result.replies[rollout]) == [
            '{"city":"San Francisco","weather_description":"The weather in San Francisco is cold."}'
        ]
    for rollout in RESTARTS:
        assert result.completed_after[result.conversation(rollout)] == {"0": 1, "1": 1}
    assert result.summary()["repeated_steps"] == 0


def test_wait_mode_continued_rollouts_resume_inside_their_turn_after_sigkill(tmp_path: Path) -> None:
    _assert_continued_inside_their_turn(_scenario(tmp_path, "wait"))


def test_replay_mode_continued_rollouts_resume_inside_their_turn_after_sigkill(tmp_path: Path) -> None:
    # The agent step is the agent's to capture in either mode: replay reruns nothing it completed.
    _assert_continued_inside_their_turn(_scenario(tmp_path, "replay"))


def test_a_restore_from_an_incremental_checkpoint_of_the_built_in_participants_continues_every_rollout(
    tmp_path: Path,
) -> None:
    # Issue 31: the second checkpoint (a sibling, nothing changed since the first) writes no record of the
    # agent, the environment, the resources server or the model server, whose records hold Gym's token capture
    # rows here (each refers to the first's); restored from it after the SIGKILL, every rollout continues
    # exactly as from a full checkpoint, and the capture Gym's trainer reads holds each call once.
    result = _scenario(tmp_path, "replay", incremental=True, token_capture=True)
    assert result.checkpoint_dir == str(tmp_path / "ckpt-2")
    manifests = {
        path.parent.parent.name: orjson.loads(path.read_bytes())
        for path in (tmp_path / "ckpt-2" / "gym").glob("*/*/manifest.json")
    }
    first = orjson.loads(next((tmp_path / "ckpt" / "gym" / "model").glob("*/manifest.json")).read_bytes())
    assert first["record_count"] == len(CONTINUED)  # each continued rollout's first call, answered
    for kind in ("agent", "environment", "resources", "model"):
        manifest = manifests[kind]
        assert manifest["schema_version"] == 2 and manifest["depends_on"] == ["ckpt"], (kind, manifest)
        assert manifest["record_count"] == 0, (kind, manifest)
    _assert_continued_inside_their_turn(result)
    for rollout in CONTINUED + RESTARTS:
        # The restored first call's row and the call sent after the crash, each once (restarts: both again).
        built = trajectories_for_rollout(f"{rollout}-a1", [tmp_path / "captures"])
        assert built is not None and built["mask_sample"] is False, (rollout, built)
        assert built["metrics"]["n_calls"] == 2 and not built["metrics"].get("capture_incomplete"), (rollout, built)
