"""The environment participant's records are versioned: a later checkpoint writes only the episodes that changed.

Episodes are asyncio tasks following ``EpisodeBook``'s contract, checkpointed through a real
``ControlPlane`` into sibling directories (``versioned_support``); ``replay`` mode, so a step in
flight does not hold a checkpoint.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from control_support import wait_until
from nemo_gym_checkpoint_plugin.builtin_participants.environment.episode_book import EpisodeBook, StepMode
from versioned_support import checkpoint, manifest_of, restore, written

from nemo_gym_checkpoint_plugin._control import ControlPlane
from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._plugins import make_plugin_manager

KIND, INSTANCE = "environment", "env"


def _plane(book: EpisodeBook) -> ControlPlane:
    return ControlPlane(make_plugin_manager([book], load_entry_points=False), kind=KIND, instance=INSTANCE)


class Stepper:
    """An episode that completes one step (boundary ``b<n>``, state ``{"n": n}``) each time it is let go."""

    def __init__(self, book: EpisodeBook, rollout_id: str) -> None:
        self.book = book
        self.episode: Any = None
        self.go = asyncio.Event()
        self.steps = 0
        self.task = asyncio.ensure_future(self._run(EpisodeId(rollout_id=rollout_id, attempt=0)))

    async def _run(self, episode_id: EpisodeId) -> None:
        episode = self.episode = self.book.begin(episode_id)
        try:
            while True:
                async with self.book.step(episode, "work"):
                    await self.go.wait()
                    self.go.clear()
                self.steps += 1
                self.book.reach(episode, f"b{self.steps}", {"n": self.steps})
        except asyncio.CancelledError:
            if not self.book.absorb_retirement(episode):
                raise
        finally:
            self.book.end(episode)

    async def step(self) -> None:
        before = self.steps
        self.go.set()
        await wait_until(lambda: self.steps == before + 1 and self.episode.step == "work", what="a step")


async def test_a_checkpoint_writes_only_the_episodes_changed_since_the_previous_one(tmp_path: Path) -> None:
    book = EpisodeBook(StepMode.REPLAY)
    plane = _plane(book)
    runs = {name: Stepper(book, name) for name in ("r0", "r1", "r2", "r3", "r4")}
    for run in runs.values():
        await run.step()
    root, full_root = tmp_path / "ckpts", tmp_path / "full"
    try:
        await checkpoint(plane, root, "step-1")
        assert sorted(written(root / "step-1", KIND, INSTANCE)) == sorted(runs)
        assert manifest_of(root / "step-1", KIND, INSTANCE)["schema_version"] == 1

        # Nothing changed: every record is referred to, none is written.
        await checkpoint(plane, root, "step-2")
        second = manifest_of(root / "step-2", KIND, INSTANCE)
        assert second["schema_version"] == 2 and second["depends_on"] == ["step-1"]
        assert written(root / "step-2", KIND, INSTANCE) == [] and second["record_count"] == 0
        assert second["segments"][0]["lines"] == [[0, 5]]

        # One step, one restart, one retire: only the stepped episode is written again.
        await runs["r1"].step()
        book.declare_restart(runs["r2"].episode)
        await plane.participants.retire([EpisodeId(rollout_id="r3", attempt=0)])
        await checkpoint(plane, root, "step-3")
        assert written(root / "step-3", KIND, INSTANCE) == ["r1"]
        third = manifest_of(root / "step-3", KIND, INSTANCE)
        assert sum(stop - start for start, stop in third["segments"][0]["lines"]) == 2  # r0 and r4

        # The same state written whole (another parent: nothing to refer to), for the restores below.
        await checkpoint(plane, full_root, "step-3", checkpoint_id="full-3")
        assert manifest_of(full_root / "step-3", KIND, INSTANCE)["schema_version"] == 1
        # Its previous checkpoint is not a sibling: step-4 is full again, then step-5 refers to it.
        await checkpoint(plane, root, "step-4")
        assert manifest_of(root / "step-4", KIND, INSTANCE)["schema_version"] == 1

        # A restart declared while a checkpoint is open is exported without its boundary: written again.
        await plane.prepare("step-5", _far())
        book.declare_restart(runs["r4"].episode)
        await plane.commit("step-5", _far(), str(root / "step-5"), None)
        await plane.resume("step-5", _far())
        assert written(root / "step-5", KIND, INSTANCE) == ["r4"]
        assert manifest_of(root / "step-5", KIND, INSTANCE)["depends_on"] == ["step-4"]
    finally:
        for run in runs.values():
            run.task.cancel()
        await asyncio.gather(*(run.task for run in runs.values()), return_exceptions=True)
        await plane.aclose()

    scope = [EpisodeId(rollout_id=name, attempt=0) for name in runs]
    installed = []
    for directory in (root / "step-3", full_root / "step-3"):
        fresh = EpisodeBook(StepMode.REPLAY)
        fresh_plane = _plane(fresh)
        try:
            reply = await restore(fresh_plane, directory, scope)
            installed.append(
                (reply["restored"], {key: (r.boundary, dict(r.state)) for key, r in fresh._restored.items()})
            )
            # A restored episode not yet begun does not change: the next checkpoint after the first refers to it.
            await checkpoint(fresh_plane, tmp_path / f"after-{directory.parent.name}", "a")
            await checkpoint(fresh_plane, tmp_path / f"after-{directory.parent.name}", "b")
            assert written(tmp_path / f"after-{directory.parent.name}" / "b", KIND, INSTANCE) == []
        finally:
            await fresh_plane.aclose()
    assert installed[0] == installed[1]
    assert installed[0][1] == {"r0-a1": ("b1", {"n": 1}), "r1-a1": ("b2", {"n": 2}), "r4-a1": ("b1", {"n": 1})}


def _far() -> float:
    import time

    return time.time() + 20.0
