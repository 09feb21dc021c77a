"""Agent-kind contract: a participant holding an agent server's per-episode sessions.

A session participant reports no restarts of its own (the environment decides them from
the agent's seed reply declaration), so the restart checks are skipped here. The agent's
own ``/run`` episodes are restarts of another plugin, ``UncapturedRuns``
(``tests/test_attach_uncaptured.py``). An episode whose
agent session was closed is past its agent step: it holds nothing to continue.
"""

from __future__ import annotations

from nemo_gym_checkpoint_plugin.testing.contracts import MakeHarness, call_hook
from nemo_gym_checkpoint_plugin.testing.contracts.base import ParticipantContract, _episode, _export, _exported_episodes

__all__ = ["TestAgentContract"]


class TestAgentContract(ParticipantContract):
    """Override ``make_harness``; the harness also needs ``finish(episode)``, closing its session over HTTP."""

    supports_restarts = False

    async def test_a_closed_session_is_not_exported(self, make_harness: MakeHarness) -> None:
        harness = await make_harness()
        open_episode, closed = _episode("open"), _episode("closed", 1)
        await harness.start(open_episode)
        await harness.start(closed)
        await harness.finish(closed)  # type: ignore[attr-defined]
        assert not harness.available(closed)
        exported = {e.capture_key for e in _exported_episodes(await _export(harness, None))}
        assert exported == {open_episode.capture_key}

    async def test_an_agent_reports_no_restarts(self, make_harness: MakeHarness) -> None:
        harness = await make_harness()
        await harness.start(_episode("plain"))
        readiness = await call_hook(harness.participant, "ready", checkpoint_id=None)
        assert readiness is None or not list(readiness.restarts)
