"""The agent participant's session records are versioned: a later checkpoint writes only the sessions that changed.

The wrapped ``simple_agent`` (mid-turn boundaries) in process against ``ScriptedPeers``
(``test_contract_agent``'s harness), checkpointed through its control plane into sibling
directories: a turn's completed call, a whole activation and a close each change one session.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from test_contract_agent import conversation, mid_turn_agents  # noqa: F401  (a fixture, used by name)
from versioned_support import checkpoint, manifest_of, restore, written

from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._types import plain_records

NAMES = ("a", "b", "c", "d", "e", "f")


def _episode(name: str, attempt: int = 0) -> EpisodeId:
    return EpisodeId(rollout_id=name, attempt=attempt)


async def _until(condition: Any, what: str) -> None:
    async with asyncio.timeout(20):
        while not condition():
            await asyncio.sleep(0.005)  # wait-ok: poll interval of a bounded wait on a condition


async def test_a_checkpoint_writes_only_the_sessions_changed_since_the_previous_one(
    mid_turn_agents: Any,  # noqa: F811  (the fixture imported above)
    tmp_path: Path,
) -> None:
    agent = await mid_turn_agents()
    plane = agent.built.control
    kind, instance = plane.kind, plane.instance
    for name in NAMES:
        await agent.start(_episode(name))
    a = _episode("a")
    # a's turn: its first model call and tool call complete, its second model call is held.
    agent.hold_model(a, 1)
    turn = agent.begin_turn(a)
    await _until(lambda: agent.model_held(a, 1), "a's second model call held")
    root, full_root = tmp_path / "ckpts", tmp_path / "full"
    try:
        await checkpoint(plane, root, "step-1")
        assert sorted(written(root / "step-1", kind, instance)) == list(NAMES)

        await checkpoint(plane, root, "step-2")
        second = manifest_of(root / "step-2", kind, instance)
        assert second["schema_version"] == 2 and second["depends_on"] == ["step-1"]
        assert written(root / "step-2", kind, instance) == []

        # a's turn records its next calls (held again at the third model call): only a is written.
        agent.hold_model(a, 2)
        agent.release_model(a, 1)
        await _until(lambda: agent.model_held(a, 2), "a's third model call held")
        await checkpoint(plane, root, "step-3")
        assert written(root / "step-3", kind, instance) == ["a"]

        # b runs a whole turn (an activation, its cookies and observations); c's session is closed.
        reply = await asyncio.wait_for(agent.begin_turn(_episode("b")), 30)
        assert reply.status_code == 200, reply.text
        await agent.finish(_episode("c"))
        await checkpoint(plane, root, "step-4")
        assert written(root / "step-4", kind, instance) == ["b"]
        fourth = manifest_of(root / "step-4", kind, instance)
        assert fourth["depends_on"] == ["step-1", "step-3"]
        assert sum(stop - start for s in fourth["segments"] for start, stop in s["lines"]) == 4  # a d e f

        await checkpoint(plane, full_root, "step-4", checkpoint_id="full-4")
        assert manifest_of(full_root / "step-4", kind, instance)["schema_version"] == 1
    finally:
        turn.cancel()
        await asyncio.gather(turn, return_exceptions=True)
        agent.release_model(a, 2)

    scope = [_episode(name) for name in NAMES]
    exports = []
    for directory in (root / "step-4", full_root / "step-4"):
        fresh = await mid_turn_agents()
        reply = await restore(fresh.built.control, directory, scope)
        assert reply["restored"] == ["a-a1", "b-a1", "d-a1", "e-a1", "f-a1"]
        records = plain_records(fresh.participant.export(checkpoint_id="after", scope=None))
        exports.append({r["episode_id"]["rollout_id"]: r for r in records})
    assert exports[0] == exports[1]  # what each restore installed, exported again
    by_key = exports[0]
    assert len(by_key["a"]["turn"]["calls"]) == 4  # two model answers and two tool results so far
    assert by_key["b"]["activations"] == 1 and by_key["d"]["activations"] == 0
    assert conversation(_episode("a")) == "weather please (a)"
