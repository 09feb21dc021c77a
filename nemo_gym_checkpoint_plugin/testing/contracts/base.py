"""The checks every participant kind that holds per-episode state must pass (shared by the kind suites).

Each check names the hookspec sentence it holds the implementation to. Hooks are called
on the plugin directly, by keyword, as the control plane calls them; episodes are opened
through the server's own routes (``Harness.start``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pytest

from nemo_gym_checkpoint_plugin._errors import CheckpointError
from nemo_gym_checkpoint_plugin._identity import EpisodeId, episode_from_wire, from_capture_key
from nemo_gym_checkpoint_plugin._storage import decode_line, encode_line
from nemo_gym_checkpoint_plugin._types import (
    MAX_REPORTED_BLOCKERS,
    ParticipantExport,
    Readiness,
    RestoredRecord,
    merge_readiness,
    plain_record,
)
from nemo_gym_checkpoint_plugin.testing.contracts import Harness, MakeHarness, call_hook

__all__ = ["ParticipantContract"]


def _episode(rollout_id: str, attempt: int = 0) -> EpisodeId:
    return EpisodeId(rollout_id=rollout_id, attempt=attempt)


def _next(episode: EpisodeId) -> EpisodeId:
    return _episode(episode.rollout_id, episode.attempt + 1)


async def _export(harness: Harness, scope: Iterable[EpisodeId] | None, checkpoint_id: str = "ck-1") -> list[Any]:
    keys = None if scope is None else frozenset(e.capture_key for e in scope)
    answer = await call_hook(harness.participant, "export", checkpoint_id=checkpoint_id, scope=keys)
    if answer is None:
        return []
    if isinstance(answer, ParticipantExport):
        answer = answer.records
    # A Versioned record (docs/plugins.md) is what its writer would write: its record, built.
    return [plain_record(item) for item in answer]


def _exported_episodes(records: list[Any]) -> list[EpisodeId]:
    episodes = []
    for record in records:
        assert isinstance(record, Mapping), record
        episodes.append(episode_from_wire(record["episode_id"]))
    return episodes


def _round_trip(records: list[Any]) -> list[Any]:
    """What a restore reads back: each record through the storage codec."""
    decoded = [decode_line(encode_line(record)) for record in records]
    assert decoded == [dict(r) for r in records]
    return decoded


def _restored(records: list[Any]) -> list[RestoredRecord]:
    out = []
    for record in records:
        checkpointed = episode_from_wire(record["episode_id"])
        out.append(RestoredRecord(checkpointed=checkpointed, replacement=_next(checkpointed), record=record))
    return out


async def _pending(harness: Harness) -> set[str]:
    return set(await call_hook(harness.participant, "restored_pending") or ())


class ParticipantContract:
    """Export, install, readiness, delete_restored and retire of one participant plugin."""

    # Whether this kind reports restarts (resources do; agents have none of their own).
    supports_restarts = False

    @pytest.fixture
    def make_harness(self) -> MakeHarness:
        raise NotImplementedError("an implementation's test class overrides the make_harness fixture")

    async def _checkpointed(self, make_harness: MakeHarness, episodes: list[EpisodeId]) -> list[Any]:
        """Start ``episodes`` on a server and return its export of everything, read back through the codec."""
        harness = await make_harness()
        for episode in episodes:
            await harness.start(episode)
        return _round_trip(await _export(harness, None))

    # -- export ------------------------------------------------------------------------------------

    async def test_export_returns_exactly_the_episodes_in_scope(self, make_harness: MakeHarness) -> None:
        harness = await make_harness()
        a, b, c = _episode("ra"), _episode("rb", 2), _episode("rc", 5)
        for episode in (a, b, c):
            await harness.start(episode)
        everything = _exported_episodes(await _export(harness, None))
        assert sorted(e.capture_key for e in everything) == sorted(e.capture_key for e in (a, b, c))
        # A scope may name episodes never seen here: they are simply absent.
        scoped = _exported_episodes(await _export(harness, [b, _episode("never-seen"), _episode("ra", 1)]))
        assert [e.capture_key for e in scoped] == [b.capture_key]
        assert await _export(harness, []) == []

    async def test_export_never_returns_a_restart(self, make_harness: MakeHarness) -> None:
        if not self.supports_restarts:
            pytest.skip("this kind reports no restarts of its own")
        harness = await make_harness()
        live, restart = _episode("live"), _episode("restart", 1)
        await harness.start(live)
        await harness.start_restart(restart)
        readiness = await call_hook(harness.participant, "ready", checkpoint_id=None)
        assert restart.capture_key in set(readiness.restarts)
        assert live.capture_key not in set(readiness.restarts)
        for scope in (None, [live, restart]):
            exported = {e.capture_key for e in _exported_episodes(await _export(harness, scope))}
            assert exported == {live.capture_key}

    async def test_records_are_json_objects_that_survive_the_storage_codec(self, make_harness: MakeHarness) -> None:
        harness = await make_harness()
        await harness.start(_episode("codec", 3))
        records = await _export(harness, None)
        assert len(records) == 1
        (record,) = _round_trip(records)
        assert record["episode_id"] == {"rollout_id": "codec", "attempt": 3}

    # -- install -----------------------------------------------------------------------------------

    async def test_install_makes_each_episode_available_as_the_next_attempt(self, make_harness: MakeHarness) -> None:
        episodes = [_episode("ia"), _episode("ib", 4)]
        records = await self._checkpointed(make_harness, episodes)
        restored = await make_harness()  # the process that restores after a crash
        await call_hook(
            restored.participant, "install", checkpoint_id="restore-1", manifest={}, records=_restored(records)
        )
        for episode in episodes:
            assert restored.available(_next(episode)), _next(episode)
            assert not restored.available(episode), episode
        replacements = {_next(e).capture_key for e in episodes}
        assert await _pending(restored) == replacements
        # A restored episode not yet started is in the next commit's scope under its replacement attempt.
        again = _exported_episodes(_round_trip(await _export(restored, None, "ck-2")))
        assert {e.capture_key for e in again} == replacements

    async def test_install_of_a_restored_attempt_chains(self, make_harness: MakeHarness) -> None:
        first = await self._checkpointed(make_harness, [_episode("chain")])
        second = await make_harness()
        await call_hook(second.participant, "install", checkpoint_id="restore-1", manifest={}, records=_restored(first))
        records = _round_trip(await _export(second, None, "ck-2"))
        third = await make_harness()
        await call_hook(
            third.participant, "install", checkpoint_id="restore-2", manifest={}, records=_restored(records)
        )
        assert third.available(_episode("chain", 2))
        assert not third.available(_episode("chain", 1)) and not third.available(_episode("chain"))

    async def test_a_refused_install_installs_nothing(self, make_harness: MakeHarness) -> None:
        good = _episode("good")
        records = await self._checkpointed(make_harness, [good])
        bad = _episode("bad", 1)
        restored = await make_harness()
        mixed = [*records, dict(restored.bad_record(bad))]
        with pytest.raises((ValueError, CheckpointError)):
            await call_hook(
                restored.participant, "install", checkpoint_id="restore-1", manifest={}, records=_restored(mixed)
            )
        assert not restored.available(_next(good)) and not restored.available(_next(bad))
        assert await _pending(restored) == set()
        assert await _export(restored, None) == []

    # -- ready -------------------------------------------------------------------------------------

    async def test_ready_answers_are_well_formed(self, make_harness: MakeHarness) -> None:
        harness = await make_harness()
        episodes = [_episode(f"ready{i}", i % 3) for i in range(MAX_REPORTED_BLOCKERS + 20)]
        restarts = [_episode(f"rs{i}") for i in range(3)] if self.supports_restarts else []
        for episode in episodes:
            await harness.start(episode)
        for episode in restarts:
            await harness.start_restart(episode)
        known = {e.capture_key for e in (*episodes, *restarts)}
        answers = []
        for checkpoint_id in (None, "ck-1"):
            answer = await call_hook(harness.participant, "ready", checkpoint_id=checkpoint_id)
            assert answer is None or isinstance(answer, Readiness), answer
            if answer is None:
                continue
            answers.append(answer)
            for key in (*answer.blockers, *answer.restarts):
                assert isinstance(key, str) and key in known and from_capture_key(key).capture_key == key
            assert set(answer.restarts) == {e.capture_key for e in restarts}
            assert all(isinstance(v, int) for v in answer.counts.values())
        # What the control plane reports from it: blockers capped, the full count beside them, restarts whole.
        status = await harness.status()
        report = status["report"]
        full = merge_readiness(answers[-1:]).to_wire() if answers else merge_readiness([]).to_wire()
        assert len(report["blockers"]) <= MAX_REPORTED_BLOCKERS
        assert report["blocker_count"] == full["blocker_count"] >= len(report["blockers"])
        assert sorted(report["restarts"]) == sorted(e.capture_key for e in restarts)
        assert report["ready"] is (full["blocker_count"] == 0)

    # -- delete_restored ---------------------------------------------------------------------------

    async def test_delete_restored_leaves_nothing_that_refuses_the_attempt(self, make_harness: MakeHarness) -> None:
        kept, dropped = _episode("kept"), _episode("dropped", 1)
        records = await self._checkpointed(make_harness, [kept, dropped])
        restored = await make_harness()
        by_key = {episode_from_wire(r["episode_id"]).capture_key: r for r in records}
        await call_hook(
            restored.participant, "install", checkpoint_id="restore-1", manifest={}, records=_restored(records)
        )
        await call_hook(restored.participant, "delete_restored", episode_ids=[_next(dropped)])
        assert not restored.available(_next(dropped))
        assert restored.available(_next(kept))
        assert await _pending(restored) == {_next(kept).capture_key}
        # Nothing refuses the attempt: it installs again, and after another delete it starts fresh.
        again = _restored([by_key[dropped.capture_key]])
        await call_hook(restored.participant, "install", checkpoint_id="restore-2", manifest={}, records=again)
        assert restored.available(_next(dropped))
        await call_hook(restored.participant, "delete_restored", episode_ids=[_next(dropped)])
        await restored.start(_next(dropped))
        assert restored.available(_next(dropped))

    # -- retire ------------------------------------------------------------------------------------

    async def test_retire_frees_the_named_attempts_and_earlier_ones_only(self, make_harness: MakeHarness) -> None:
        harness = await make_harness()
        named, earlier, later, other = (
            _episode("named", 2),
            _episode("earlier"),
            _episode("later", 4),
            _episode("other"),
        )
        for episode in (named, earlier, later, other):
            await harness.start(episode)
        await call_hook(
            harness.participant, "retire", episode_ids=[named, _episode("earlier", 1), _episode("later", 3)]
        )
        assert not harness.available(named) and not harness.available(earlier)
        assert harness.available(later) and harness.available(other)
        exported = {e.capture_key for e in _exported_episodes(await _export(harness, None))}
        assert exported == {later.capture_key, other.capture_key}
        # The retired rollouts' next attempts start cleanly.
        await harness.start(_next(named))
        assert harness.available(_next(named))

    async def test_retire_frees_a_restored_attempt(self, make_harness: MakeHarness) -> None:
        episode = _episode("restored-then-retired")
        records = await self._checkpointed(make_harness, [episode])
        restored = await make_harness()
        await call_hook(
            restored.participant, "install", checkpoint_id="restore-1", manifest={}, records=_restored(records)
        )
        await call_hook(restored.participant, "retire", episode_ids=[_next(episode)])
        assert not restored.available(_next(episode))
        assert await _pending(restored) == set()
        assert await _export(restored, None) == []

    async def test_retire_of_a_restart_stops_reporting_it(self, make_harness: MakeHarness) -> None:
        if not self.supports_restarts:
            pytest.skip("this kind reports no restarts of its own")
        harness = await make_harness()
        restart = _episode("gone", 2)
        await harness.start_restart(restart)
        await call_hook(harness.participant, "retire", episode_ids=[restart])
        readiness = await call_hook(harness.participant, "ready", checkpoint_id=None)
        assert restart.capture_key not in set(readiness.restarts if readiness is not None else ())
