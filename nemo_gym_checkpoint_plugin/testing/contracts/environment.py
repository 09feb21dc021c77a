"""Environment-kind contract: a participant holding an environment server's episodes and their steps.

docs/protocol.md "Episode steps" and "Restarts" on top of the shared checks. The harness's
``start`` leaves the episode in flight *inside a step* (its server's real callers are
held), and it also needs ``finish_step(episode)``: let that step complete, so the episode
reaches its next boundary. Environments report restarts (an episode some other
participant cannot capture), so the restart checks run.
"""

from __future__ import annotations

import asyncio

from nemo_gym_checkpoint_plugin.testing.contracts import Harness, MakeHarness, call_hook
from nemo_gym_checkpoint_plugin.testing.contracts.base import (
    ParticipantContract,
    _episode,
    _export,
    _exported_episodes,
    _next,
    _restored,
    _round_trip,
)

__all__ = ["TestEnvironmentContract"]

_BOUND_SECONDS = 10.0


async def _blockers(harness: Harness, checkpoint_id: str | None) -> set[str]:
    readiness = await call_hook(harness.participant, "ready", checkpoint_id=checkpoint_id)
    return set(readiness.blockers) if readiness is not None else set()


async def _until_no_blockers(harness: Harness, checkpoint_id: str) -> None:
    async with asyncio.timeout(_BOUND_SECONDS):
        while await _blockers(harness, checkpoint_id):
            await call_hook(harness.participant, "wait_ready", checkpoint_id=checkpoint_id)


class TestEnvironmentContract(ParticipantContract):
    """Override ``make_harness``; the harness also needs ``finish_step(episode)``."""

    supports_restarts = True

    async def test_a_step_in_flight_blocks_a_checkpoint_until_its_boundary(self, make_harness: MakeHarness) -> None:
        harness = await make_harness()
        stepping, restart = _episode("stepping"), _episode("restart-in-step")
        await harness.start(stepping)
        await harness.start_restart(restart)
        await call_hook(harness.participant, "close_admission", checkpoint_id="ck-1")
        try:
            # wait mode: the step in flight blocks; a restart never does.
            assert await _blockers(harness, "ck-1") == {stepping.capture_key}
            await harness.finish_step(stepping)  # type: ignore[attr-defined]
            await _until_no_blockers(harness, "ck-1")
            # Parked at its new boundary: exported from there, and a restored attempt continues from it.
            (record,) = _round_trip(await _export(harness, None))
            restored = await make_harness()
            await call_hook(
                restored.participant, "install", checkpoint_id="restore-1", manifest={}, records=_restored([record])
            )
            assert restored.available(_next(stepping))
        finally:
            await call_hook(harness.participant, "open_admission", checkpoint_id="ck-1")

    async def test_an_episode_being_retired_is_not_exported(self, make_harness: MakeHarness) -> None:
        harness = await make_harness()
        kept, retired = _episode("kept"), _episode("retired", 1)
        await harness.start(kept)
        await harness.start(retired)
        await call_hook(harness.participant, "retire", episode_ids=[retired])
        # retire returned: the attempt's task has ended, and it is gone from every later export.
        assert not harness.available(retired)
        exported = {e.capture_key for e in _exported_episodes(await _export(harness, None))}
        assert exported == {kept.capture_key}
