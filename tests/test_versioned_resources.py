"""The resources participant's binding records are versioned: a later checkpoint writes only new bindings.

``example_single_tool_call`` built in process (``gym_inprocess``), its sessions seeded and closed
over its own routes, checkpointed through its control plane into sibling directories.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from gym_inprocess import GymServers, InProcessServer
from nemo_gym_checkpoint_plugin.builtin_participants.resources.session_bindings import ResourcesSessions
from versioned_support import checkpoint, manifest_of, restore, written

from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin.testing.gym_config import RESOURCES


def _wire(rollout_id: str) -> dict[str, Any]:
    return {"rollout_id": rollout_id, "attempt": 0}


async def _seed(built: InProcessServer, rollout_id: str) -> None:
    body = {
        "resources_session_id": f"res-{rollout_id}",
        "episode_id": _wire(rollout_id),
        "task_id": {"taskset": "t", "task_id": rollout_id},
        "task_data": {},
    }
    reply = await built.post("/seed_session", body)
    assert reply.status_code == 200, reply.text


async def _close(built: InProcessServer, rollout_id: str) -> None:
    reply = await built.post(
        "/close_session", {"resources_session_id": f"res-{rollout_id}", "episode_id": _wire(rollout_id)}
    )
    assert reply.status_code == 200, reply.text


@pytest.fixture
async def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[GymServers]:
    built = GymServers(tmp_path / "gym", monkeypatch, RESOURCES)
    yield built
    await built.aclose()


async def test_a_checkpoint_writes_only_the_bindings_seeded_since_the_previous_one(
    servers: GymServers, tmp_path: Path
) -> None:
    built = servers.build(ResourcesSessions)
    plane = built.control
    kind, instance = plane.kind, plane.instance
    for name in ("r0", "r1", "r2", "r3"):
        await _seed(built, name)
    root, full_root = tmp_path / "ckpts", tmp_path / "full"
    await checkpoint(plane, root, "step-1")
    assert sorted(written(root / "step-1", kind, instance)) == ["r0", "r1", "r2", "r3"]

    await checkpoint(plane, root, "step-2")
    second = manifest_of(root / "step-2", kind, instance)
    assert second["schema_version"] == 2 and second["depends_on"] == ["step-1"]
    assert written(root / "step-2", kind, instance) == []

    # A new session, one closed, one retired: only the new one is written.
    await _seed(built, "r4")
    await _close(built, "r1")
    await plane.participants.retire([EpisodeId(rollout_id="r2", attempt=0)])
    await checkpoint(plane, root, "step-3")
    assert written(root / "step-3", kind, instance) == ["r4"]
    third = manifest_of(root / "step-3", kind, instance)
    assert third["segments"][0]["lines"] == [[0, 1], [3, 4]]  # r0 and r3 of step-1's file

    await checkpoint(plane, full_root, "step-3", checkpoint_id="full-3")
    assert manifest_of(full_root / "step-3", kind, instance)["schema_version"] == 1

    scope = [EpisodeId(rollout_id=name, attempt=0) for name in ("r0", "r1", "r2", "r3", "r4")]
    installed = []
    for directory in (root / "step-3", full_root / "step-3"):
        fresh = servers.build(ResourcesSessions)
        reply = await restore(fresh.control, directory, scope)
        bindings = {
            sid: (ep.capture_key, tid.model_dump()) for sid, (ep, tid) in fresh.server._session_episodes.items()
        }
        installed.append((reply["restored"], bindings))
    assert installed[0] == installed[1]
    assert sorted(installed[0][1]) == ["res-r0", "res-r3", "res-r4"]
