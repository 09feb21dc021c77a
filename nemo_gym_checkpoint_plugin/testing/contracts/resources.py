"""Resources-kind contract: a participant holding a resources server's per-episode session bindings.

Resources servers declare restarts at seed time (a task that cannot be captured), so the
restart checks run. A closed session is the end of an episode on this server: it is
neither exported nor reported as a restart any more.
"""

from __future__ import annotations

from nemo_gym_checkpoint_plugin.testing.contracts import MakeHarness, call_hook
from nemo_gym_checkpoint_plugin.testing.contracts.base import ParticipantContract, _episode, _export, _exported_episodes

__all__ = ["TestResourcesContract"]


class TestResourcesContract(ParticipantContract):
    """Override ``make_harness``; the harness also needs ``finish(episode)``, closing its session over HTTP."""

    supports_restarts = True

    async def test_a_closed_session_is_neither_exported_nor_a_restart(self, make_harness: MakeHarness) -> None:
        harness = await make_harness()
        open_episode, closed, closed_restart = _episode("open"), _episode("closed", 1), _episode("closed-rs")
        await harness.start(open_episode)
        await harness.start(closed)
        await harness.start_restart(closed_restart)
        await harness.finish(closed)  # type: ignore[attr-defined]
        await harness.finish(closed_restart)  # type: ignore[attr-defined]
        assert not harness.available(closed)
        exported = {e.capture_key for e in _exported_episodes(await _export(harness, None))}
        assert exported == {open_episode.capture_key}
        readiness = await call_hook(harness.participant, "ready", checkpoint_id=None)
        assert closed_restart.capture_key not in set(readiness.restarts if readiness is not None else ())
