"""Agent-kind contract: a participant holding an agent server's per-episode sessions.

A session participant reports no restarts of its own (the environment decides them from
the agent's seed reply declaration), so the restart checks are skipped here. The agent's
own ``/run`` episodes are restarts of another plugin, ``UncapturedRuns``
(``tests/test_attach_uncaptured.py``). An episode whose
agent session was closed is past its agent step: it holds nothing to continue.

**Mid-turn boundaries** (docs/protocol.md): an agent that declares ``mid-turn`` sets
``supports_mid_turn = True`` and its harness also implements ``MidTurnHarness``. Its turns
run against a model and tools the harness scripts (a turn calls a tool ``rounds`` times,
then answers; a model call at ``step`` n is the one made after n tool calls), and the
harness counts what those servers completed across every server ``make_harness`` built
(they stand for the model and resources servers, which a crash of the agent does not reset).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping
from typing import Any, Protocol

import pytest

from nemo_gym_checkpoint_plugin._identity import EpisodeId
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

__all__ = ["MidTurnHarness", "TestAgentContract"]

# Bound of every wait on a condition in these checks.
_BOUND_SECONDS = 10.0


class MidTurnHarness(Harness, Protocol):
    """What the mid-turn checks drive besides ``Harness``: turns, held model calls, held tools, counts."""

    rounds: int

    def begin_turn(self, episode: EpisodeId) -> asyncio.Task[Any]:
        """Send the episode's turn (same request for every attempt); the task ends with its reply."""
        ...

    def hold_model(self, episode: EpisodeId, step: int) -> None: ...

    def release_model(self, episode: EpisodeId, step: int) -> None: ...

    def model_held(self, episode: EpisodeId, step: int) -> bool: ...

    def hold_tools(self) -> None: ...

    def release_tools(self) -> None: ...

    def tools_in_flight(self) -> int: ...

    def model_completed(self, episode: EpisodeId) -> Mapping[int, int]:
        """Completed model calls of the episode's conversation per step, on every server built."""
        ...

    def tool_calls(self, episode: EpisodeId) -> int:
        """Tool calls the episode's rollout made (any attempt), on every server built."""
        ...

    def turn_result_ok(self, reply: Any) -> bool:
        """Whether a turn's reply is a successful answer (not a refusal)."""
        ...


async def _until(predicate: Any, what: str) -> None:
    async with asyncio.timeout(_BOUND_SECONDS):
        while not predicate():
            await asyncio.sleep(0.005)  # wait-ok: poll interval of a bounded wait on a condition
    assert predicate(), what


def _turn(records: list[Any], episode: EpisodeId) -> Mapping[str, Any]:
    (record,) = [r for r, e in zip(records, _exported_episodes(records), strict=True) if e == episode]
    turn = record.get("turn")
    assert isinstance(turn, Mapping), f"a mid-turn agent exports the turn so far: {record}"
    return turn


class TestAgentContract(ParticipantContract):
    """Override ``make_harness``; the harness also needs ``finish(episode)``, closing its session over HTTP."""

    supports_restarts = False
    # Set by an agent declaring mid-turn boundaries; its harness implements MidTurnHarness.
    supports_mid_turn = False

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

    # -- mid-turn boundaries ------------------------------------------------------------------------

    async def _mid_turn(self, make_harness: MakeHarness) -> MidTurnHarness:
        if not self.supports_mid_turn:
            pytest.skip("this agent declares no mid-turn boundaries")
        return await make_harness()  # type: ignore[return-value]

    async def _held_at(self, harness: MidTurnHarness, episode: EpisodeId, step: int) -> asyncio.Task[Any]:
        await harness.start(episode)
        harness.hold_model(episode, step)
        turn = harness.begin_turn(episode)
        await _until(lambda: harness.model_held(episode, step) or turn.done(), "the model call held")
        assert not turn.done(), turn.result()
        return turn

    async def test_mid_turn_a_held_model_call_never_blocks_and_the_turn_so_far_is_exported(
        self, make_harness: MakeHarness
    ) -> None:
        harness = await self._mid_turn(make_harness)
        episode = _episode("held")
        turn = await self._held_at(harness, episode, 1)
        await call_hook(harness.participant, "close_admission", checkpoint_id="ck-1")
        try:
            readiness = await call_hook(harness.participant, "ready", checkpoint_id="ck-1")
            assert readiness is None or not list(readiness.blockers)
            calls = _turn(_round_trip(await _export(harness, None)), episode)["calls"]
            # The boundary after the first model call and its tool call; the held call belongs to no checkpoint.
            assert [c["call"] for c in calls] == ["model", "tool"]
        finally:
            await call_hook(harness.participant, "open_admission", checkpoint_id="ck-1")
        harness.release_model(episode, 1)
        assert harness.turn_result_ok(await asyncio.wait_for(turn, _BOUND_SECONDS))
        assert dict(harness.model_completed(episode)) == dict.fromkeys(range(harness.rounds + 1), 1)

    async def test_mid_turn_a_turn_parks_at_its_next_boundary(self, make_harness: MakeHarness) -> None:
        harness = await self._mid_turn(make_harness)
        episode = _episode("parks")
        turn = await self._held_at(harness, episode, 1)
        await call_hook(harness.participant, "close_admission", checkpoint_id="ck-1")
        try:
            harness.release_model(episode, 1)  # its answer arrives while the checkpoint is open
            await _until(lambda: harness.model_completed(episode).get(1) == 1, "the held call answered")

            async def parked() -> bool:
                readiness = await call_hook(harness.participant, "ready", checkpoint_id="ck-1")
                return readiness is not None and readiness.counts.get("turns_parked") == 1

            async with asyncio.timeout(_BOUND_SECONDS):
                while not await parked():
                    await asyncio.sleep(0.005)  # wait-ok: poll interval of a bounded wait on a condition
            first = _round_trip(await _export(harness, None))
            # Parked right after that answer: no tool call started, and a second export is the same.
            assert [c["call"] for c in _turn(first, episode)["calls"]] == ["model", "tool", "model"]
            assert harness.tool_calls(episode) == 1
            assert _round_trip(await _export(harness, None)) == first
        finally:
            await call_hook(harness.participant, "open_admission", checkpoint_id="ck-1")
        assert harness.turn_result_ok(await asyncio.wait_for(turn, _BOUND_SECONDS))
        assert harness.tool_calls(episode) == harness.rounds

    async def test_mid_turn_a_tool_call_in_flight_blocks_until_it_is_recorded(self, make_harness: MakeHarness) -> None:
        harness = await self._mid_turn(make_harness)
        episode, turn = await _tool_call_in_flight(harness, "tooling")
        await call_hook(harness.participant, "close_admission", checkpoint_id="ck-1")
        try:
            readiness = await call_hook(harness.participant, "ready", checkpoint_id="ck-1")
            assert list(readiness.blockers) == [episode.capture_key]
            waiting = asyncio.ensure_future(call_hook(harness.participant, "wait_ready", checkpoint_id="ck-1"))
            harness.release_tools()
            await asyncio.wait_for(waiting, _BOUND_SECONDS)
            await _until_unblocked(harness)
            calls = _turn(_round_trip(await _export(harness, None)), episode)["calls"]
            assert [c["call"] for c in calls] == ["model", "tool"]
        finally:
            await call_hook(harness.participant, "open_admission", checkpoint_id="ck-1")
        assert harness.turn_result_ok(await asyncio.wait_for(turn, _BOUND_SECONDS))

    async def test_mid_turn_wait_ready_wakes_for_a_change_made_before_its_answer_is_awaited(
        self, make_harness: MakeHarness
    ) -> None:
        # The control plane calls wait_ready right after a ready answer with blockers and awaits what it
        # returned later (a task that first runs on a later turn of the loop): a blocker that cleared in
        # between is a change, and must wake it, or the prepare waits out its whole deadline for nothing.
        harness = await self._mid_turn(make_harness)
        episode, turn = await _tool_call_in_flight(harness, "cleared-early")
        await call_hook(harness.participant, "close_admission", checkpoint_id="ck-1")
        try:
            readiness = await call_hook(harness.participant, "ready", checkpoint_id="ck-1")
            assert list(readiness.blockers) == [episode.capture_key]
            answer = harness.participant.wait_ready(checkpoint_id="ck-1")
            harness.release_tools()
            await _until_unblocked(harness)
            if inspect.isawaitable(answer):
                await asyncio.wait_for(answer, _BOUND_SECONDS)
        finally:
            await call_hook(harness.participant, "open_admission", checkpoint_id="ck-1")
        assert harness.turn_result_ok(await asyncio.wait_for(turn, _BOUND_SECONDS))

    async def test_mid_turn_a_restored_turn_continues_without_sending_completed_calls_again(
        self, make_harness: MakeHarness
    ) -> None:
        harness = await self._mid_turn(make_harness)
        episode = _episode("continued")
        turn = await self._held_at(harness, episode, 1)
        await call_hook(harness.participant, "close_admission", checkpoint_id="ck-1")
        records = _round_trip(await _export(harness, [episode]))
        turn.cancel()  # the process dies: its held call is never answered
        await asyncio.gather(turn, return_exceptions=True)
        await _until(lambda: not harness.model_held(episode, 1), "the model noticed its caller went away")
        harness.release_model(episode, 1)
        restored = await self._mid_turn(make_harness)
        await call_hook(restored.participant, "install", checkpoint_id="r-1", manifest={}, records=_restored(records))
        reply = await asyncio.wait_for(restored.begin_turn(_next(episode)), _BOUND_SECONDS)
        assert restored.turn_result_ok(reply)
        # Every model call and tool call completed once, across both servers.
        assert dict(restored.model_completed(episode)) == dict.fromkeys(range(restored.rounds + 1), 1)
        assert restored.tool_calls(episode) == restored.rounds

    async def test_mid_turn_retire_cancels_the_running_turn_and_frees_its_session(
        self, make_harness: MakeHarness
    ) -> None:
        harness = await self._mid_turn(make_harness)
        episode = _episode("retired")
        turn = await self._held_at(harness, episode, 1)
        await asyncio.wait_for(call_hook(harness.participant, "retire", episode_ids=[episode]), _BOUND_SECONDS)
        # Retire returned only once the turn had stopped, its session gone; the turn's reply is a refusal.
        readiness = await call_hook(harness.participant, "ready", checkpoint_id=None)
        assert readiness.counts.get("turns_running") == 0
        assert not harness.available(episode)
        assert not harness.turn_result_ok(await asyncio.wait_for(turn, _BOUND_SECONDS))
        assert harness.model_completed(episode).get(1) is None


async def _tool_call_in_flight(harness: Any, name: str) -> tuple[EpisodeId, asyncio.Task[Any]]:
    """A started episode ``name`` whose turn is held in its first tool call; the episode and its turn."""
    episode = _episode(name)
    await harness.start(episode)
    harness.hold_tools()
    turn = harness.begin_turn(episode)
    await _until(lambda: harness.tools_in_flight() == 1 or turn.done(), "a tool call in flight")
    return episode, turn


async def _until_unblocked(harness: Any) -> None:
    """Wait (bounded) until the participant's readiness names no blocker."""

    async def unblocked() -> bool:
        return not list((await call_hook(harness.participant, "ready", checkpoint_id="ck-1")).blockers)

    async with asyncio.timeout(_BOUND_SECONDS):
        while not await unblocked():
            await asyncio.sleep(0.005)  # wait-ok: poll interval of a bounded wait on a condition
