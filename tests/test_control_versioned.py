"""Versioned records through the control plane: the second commit refers to what did not change.

A third-party plugin exports ``Versioned`` records; the control plane tags them with the plugin's
name, the writer builds only the changed ones, and a restore hands the plugin all of its records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from control_support import close_harness, make_harness, wire

from nemo_gym_checkpoint_plugin.api import Versioned, capture_key, episode_to_wire, from_capture_key, hookimpl


class Counters:
    """Per-episode counters with a version each (raised on every change), exported as Versioned."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self.versions: dict[str, int] = {}
        self.built: list[str] = []
        self.installed: dict[str, Any] = {}

    def set(self, key: str, value: int) -> None:
        self.values[key] = value
        self.versions[key] = self.versions.get(key, 0) + 1

    @hookimpl
    def export(self, checkpoint_id: str, scope: frozenset[str] | None) -> list[Versioned]:
        items = []
        for key in sorted(self.values):
            episode = episode_to_wire(from_capture_key(key))

            def build(key: str = key, episode: dict = episode) -> dict:
                self.built.append(key)
                return {"episode_id": episode, "value": self.values[key]}

            items.append(Versioned(episode, self.versions[key], build))
        return items

    @hookimpl
    def install(self, records: list, scope: list) -> None:
        for restored in records:
            self.installed[restored.replacement.capture_key] = dict(restored.record)


async def test_the_second_commit_builds_only_the_changed_record_and_restores_them_all(tmp_path: Path) -> None:
    counters = Counters()
    for index in range(5):
        counters.set(capture_key(f"r{index}", 0), index)
    harness = await make_harness(tmp_path / "a", named_plugins={"acme_counters": counters})
    root = tmp_path / "ckpts"
    try:
        manifests = []
        for step in (1, 2):
            await harness.call("prepare", checkpoint_id=f"step-{step}")
            reply = await harness.call(
                "commit", checkpoint_id=f"step-{step}", checkpoint_dir=str(root / f"step-{step}"), episode_ids=None
            )
            manifests.append(reply["manifest"])
            assert sorted(reply["episode_ids"]) == [capture_key(f"r{i}", 0) for i in range(5)]
            await harness.call("resume", checkpoint_id=f"step-{step}")
            if step == 1:
                assert len(counters.built) == 5
                counters.built.clear()
                counters.set(capture_key("r2", 0), 20)
    finally:
        await close_harness(harness)
    assert manifests[0]["schema_version"] == 1
    assert manifests[1]["schema_version"] == 2 and manifests[1]["depends_on"] == ["step-1"]
    assert counters.built == [capture_key("r2", 0)]

    fresh = Counters()
    restoring = await make_harness(tmp_path / "b", named_plugins={"acme_counters": fresh})
    try:
        await restoring.call(
            "restore",
            checkpoint_id="re-1",
            checkpoint_dir=str(root / "step-2"),
            episode_ids=[wire(f"r{i}") for i in range(5)],
        )
    finally:
        await close_harness(restoring)
    values = {key: record["value"] for key, record in fresh.installed.items()}
    assert values == {capture_key(f"r{i}", 1): (20 if i == 2 else i) for i in range(5)}
    assert {record["plugin"] for record in fresh.installed.values()} == {"acme_counters"}
