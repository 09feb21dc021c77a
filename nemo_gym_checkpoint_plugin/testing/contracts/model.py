"""Model-kind contract: a policy model participant (docs/protocol.md, "Mid-turn boundaries").

A model participant keeps no episode of its own between calls; what it owes a checkpoint is
about the calls in flight:

- readiness never waits for a generation: no blockers, no restarts, whatever runs or is held;
- after ``close_admission`` a call still generating keeps running, and its response, not
  started yet, is held until ``open_admission``, then delivered as an uninterrupted call's;
- a held call belongs to no checkpoint: nothing is exported for its episode;
- ``retire`` stops the running calls of the named attempts and earlier ones (the inference
  worker sees the request dropped), waits for them, and their callers are refused with
  ``stale_attempt``; calls of later attempts and other rollouts run on;
- ``install`` and ``delete_restored`` leave nothing that refuses the attempt later.

The harness (``make_harness`` builds a fresh server with its participant) drives real model
calls through the server's routes, with the inference worker under the test's control::

    class ModelHarness(Protocol):
        participant: Any
        async def begin(self, episode: EpisodeId) -> ModelCallHandle: ...
            # a model call under /ng-rollout/<capture key>/, returned once it generates at the worker
        def same_answer(self, held: Mapping, uninterrupted: Mapping) -> bool: ...
            # two replies to the same request are the same answer (ids and timestamps may differ)

    class ModelCallHandle(Protocol):
        async def finish(self) -> None: ...   # the worker answers now
        def done(self) -> bool: ...           # the caller has its whole reply
        async def reply(self) -> tuple[int, Mapping]: ...  # status and JSON body, once done
        async def dropped(self) -> bool: ...  # the worker saw the request dropped (waits a bounded time)
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._types import ParticipantExport, RestoredRecord, plain_record
from nemo_gym_checkpoint_plugin.testing.contracts import MakeHarness, call_hook

__all__ = ["TestModelContract"]

# How long a caller's reply may take to arrive once it is due (an in-process or local round trip).
_DUE_SECONDS = 20.0


def _episode(rollout_id: str, attempt: int = 0) -> EpisodeId:
    return EpisodeId(rollout_id=rollout_id, attempt=attempt)


async def _blockers_and_restarts(participant: Any, checkpoint_id: str | None) -> list[str]:
    readiness = await call_hook(participant, "ready", checkpoint_id=checkpoint_id)
    return [] if readiness is None else [*readiness.blockers, *readiness.restarts]


async def _exported_keys(participant: Any, scope: frozenset[str] | None) -> set[str]:
    answer = await call_hook(participant, "export", checkpoint_id="ck-model", scope=scope)
    if isinstance(answer, ParticipantExport):
        answer = answer.records
    keys = set()
    for record in map(plain_record, answer or ()):
        episode = record["episode_id"]
        keys.add(_episode(episode["rollout_id"], episode["attempt"]).capture_key)
    return keys


async def _replied(call: Any) -> tuple[int, Any]:
    return await asyncio.wait_for(call.reply(), _DUE_SECONDS)


class TestModelContract:
    """Override ``make_harness`` (see the module docstring for the harness it returns)."""

    @pytest.fixture
    def make_harness(self) -> MakeHarness:
        raise NotImplementedError("an implementation's test class overrides the make_harness fixture")

    async def test_readiness_never_waits_for_a_generation(self, make_harness: MakeHarness) -> None:
        harness = await make_harness()
        participant = harness.participant
        generating = await harness.begin(_episode("gen"))  # type: ignore[attr-defined]
        finished = await harness.begin(_episode("fin", 2))  # type: ignore[attr-defined]
        await call_hook(participant, "close_admission", checkpoint_id="ck-1")
        assert await _blockers_and_restarts(participant, "ck-1") == []
        await finished.finish()  # its response is now held
        assert await _blockers_and_restarts(participant, "ck-1") == []
        assert not finished.done()
        await call_hook(participant, "open_admission", checkpoint_id="ck-1")
        await generating.finish()
        assert (await _replied(finished))[0] == (await _replied(generating))[0] == 200

    async def test_a_response_not_started_is_held_until_admission_reopens(self, make_harness: MakeHarness) -> None:
        harness = await make_harness()
        participant = harness.participant
        uninterrupted = await harness.begin(_episode("same"))  # type: ignore[attr-defined]
        await uninterrupted.finish()
        reference = await _replied(uninterrupted)
        held = await harness.begin(_episode("same", 1))  # type: ignore[attr-defined]
        await call_hook(participant, "close_admission", checkpoint_id="ck-1")
        await held.finish()
        # The worker answered; the caller gets nothing while admission is closed.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(held.reply()), 0.5)
        assert not held.done()
        await call_hook(participant, "open_admission", checkpoint_id="ck-1")
        status, body = await _replied(held)
        assert status == reference[0] == 200
        assert harness.same_answer(body, reference[1])  # type: ignore[attr-defined]

    async def test_a_held_call_belongs_to_no_checkpoint(self, make_harness: MakeHarness) -> None:
        harness = await make_harness()
        participant = harness.participant
        episode = _episode("held-export", 3)
        held = await harness.begin(episode)  # type: ignore[attr-defined]
        await call_hook(participant, "close_admission", checkpoint_id="ck-1")
        await held.finish()
        assert episode.capture_key not in await _exported_keys(participant, frozenset({episode.capture_key}))
        assert episode.capture_key not in await _exported_keys(participant, None)
        await call_hook(participant, "open_admission", checkpoint_id="ck-1")
        assert (await _replied(held))[0] == 200

    async def test_retire_stops_the_attempts_running_calls_and_waits(self, make_harness: MakeHarness) -> None:
        harness = await make_harness()
        named = await harness.begin(_episode("ret", 2))  # type: ignore[attr-defined]
        earlier = await harness.begin(_episode("ret", 1))  # type: ignore[attr-defined]
        later = await harness.begin(_episode("ret", 3))  # type: ignore[attr-defined]
        other = await harness.begin(_episode("other", 2))  # type: ignore[attr-defined]
        await call_hook(harness.participant, "retire", episode_ids=[_episode("ret", 2)])
        for stopped in (named, earlier):
            assert stopped.done()  # retire returned only after the call ended
            status, body = await _replied(stopped)
            assert status == 409 and body["error"]["code"] == "stale_attempt"
            assert await stopped.dropped()
        assert not later.done() and not other.done()
        await later.finish()
        await other.finish()
        assert (await _replied(later))[0] == (await _replied(other))[0] == 200

    async def test_retire_stops_a_held_response(self, make_harness: MakeHarness) -> None:
        harness = await make_harness()
        participant = harness.participant
        held = await harness.begin(_episode("held-ret"))  # type: ignore[attr-defined]
        await call_hook(participant, "close_admission", checkpoint_id="restore-1")
        await held.finish()
        await call_hook(participant, "retire", episode_ids=[_episode("held-ret")])
        status, body = await _replied(held)
        assert status == 409 and body["error"]["code"] == "stale_attempt"
        await call_hook(participant, "open_admission", checkpoint_id="restore-1")

    async def test_install_and_delete_restored_leave_nothing_that_refuses_the_attempt(
        self, make_harness: MakeHarness
    ) -> None:
        harness = await make_harness()
        participant = harness.participant
        checkpointed = _episode("restored", 1)
        replacement = _episode("restored", 2)
        records: list[RestoredRecord] = []
        await call_hook(
            participant, "install", checkpoint_id="restore-1", manifest={}, records=records, scope=[replacement]
        )
        await call_hook(participant, "delete_restored", episode_ids=[replacement])
        assert replacement.capture_key not in set(await call_hook(participant, "restored_pending") or ())
        call = await harness.begin(replacement)  # type: ignore[attr-defined]
        await call.finish()
        assert (await _replied(call))[0] == 200
        assert checkpointed.capture_key not in await _exported_keys(participant, None)
