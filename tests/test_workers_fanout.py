"""A main process's plane and coordinator with several workers over real Unix sockets, in one event loop.

The plane's participant is the coordinator's fan-out (``_workers/fanout.py``); each worker
(``_workers/worker.py``) runs its own in-test participant. Every test drives the plane as the
routes would and checks what each worker's participant and gate state saw.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from control_support import Gate, deadline, wait_until, wire
from workers_support import TIMEOUT, Cluster

from nemo_gym_checkpoint_plugin._errors import AttemptRunning, ExportFailed, InvalidCheckpointState, InvalidPhase
from nemo_gym_checkpoint_plugin._identity import episode_id, from_capture_key
from nemo_gym_checkpoint_plugin._markers import hookimpl
from nemo_gym_checkpoint_plugin._storage.codec import decode_line
from nemo_gym_checkpoint_plugin._types import RestoredRecord, Versioned


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    made = Cluster(3)
    try:
        await made.start(101, 102, 103)
        yield made
    finally:
        await made.aclose()


def _ids(*keys: str) -> list:
    return [from_capture_key(key) for key in keys]


async def test_prepare_closes_every_worker_and_waits_for_every_readiness(cluster: Cluster) -> None:
    cluster.participants[102].blockers.add("r2")
    reply = await cluster.plane.prepare("c1", deadline(0.5))
    assert reply["phase"] == "preparing"
    assert reply["report"]["blockers"] == ["r2"]
    assert "worker_blockers" not in reply["report"]
    for pid, worker in cluster.workers.items():
        assert not worker.admission.is_open, pid
        assert cluster.participants[pid].called("close_admission") == [{"checkpoint_id": "c1"}]
    cluster.participants[102].unblock("r2")
    reply = await cluster.plane.prepare("c1", deadline())
    assert reply["phase"] == "prepared"
    assert reply["report"]["counts"] == {"workers": 3, "episodes": 0}
    await cluster.plane.resume("c1", deadline())
    for pid, worker in cluster.workers.items():
        assert worker.admission.is_open, pid
        assert cluster.participants[pid].called("open_admission") == [{"checkpoint_id": "c1"}]


async def test_a_missing_worker_blocks_naming_it_apart_from_capture_keys() -> None:
    cluster = Cluster(3)
    try:
        await cluster.start(101, 102)
        reply = await cluster.plane.prepare("c1", deadline(0.5))
        assert reply["phase"] == "preparing"
        assert reply["report"]["ready"] is False
        assert reply["report"]["blockers"] == [] and reply["report"]["blocker_count"] == 0
        assert reply["report"]["worker_blockers"] == ["worker not registered (2 of 3), #1"]
        # The late worker registers with admission closed for c1 (the snapshot) and the prepare completes.
        late = await cluster.worker(103)
        assert not late.admission.is_open and late.closed_for == "c1"
        assert cluster.participants[103].called("close_admission") == [{"checkpoint_id": "c1"}]
        reply = await cluster.plane.prepare("c1", deadline())
        assert reply["phase"] == "prepared"
    finally:
        await cluster.aclose()


async def test_a_worker_lost_mid_prepare_blocks_it_for_good(cluster: Cluster) -> None:
    cluster.participants[101].blockers.add("r1")
    assert (await cluster.plane.prepare("c1", deadline(0.3)))["phase"] == "preparing"
    await cluster.lose(102)
    await cluster.worker(104)  # a replacement never saw c1's admission close happen to what 102 held
    cluster.participants[101].unblock("r1")
    reply = await cluster.plane.prepare("c1", deadline(0.5))
    assert reply["phase"] == "preparing"
    assert reply["report"]["worker_blockers"] == ["worker 102 disconnected during c1"]
    await cluster.plane.resume("c1", deadline())
    # The next checkpoint is not blocked by it.
    assert (await cluster.plane.prepare("c2", deadline()))["phase"] == "prepared"


async def test_a_worker_lost_after_readiness_fails_the_commit_for_good(cluster: Cluster, tmp_path: Path) -> None:
    cluster.participants[101].add("r1")
    assert (await cluster.plane.prepare("c1", deadline()))["phase"] == "prepared"
    await cluster.lose(103)
    with pytest.raises(ExportFailed, match="worker 103"):
        await cluster.plane.commit("c1", deadline(), str(tmp_path), None)
    with pytest.raises(ExportFailed):
        await cluster.plane.commit("c1", deadline(), str(tmp_path), None)
    assert not list(tmp_path.rglob("manifest.json"))


async def test_the_commit_writes_every_workers_records(cluster: Cluster, tmp_path: Path) -> None:
    cluster.participants[101].add("r1")
    cluster.participants[102].add("r2", "r3")
    assert (await cluster.plane.prepare("c1", deadline()))["phase"] == "prepared"
    reply = await cluster.plane.commit("c1", deadline(), str(tmp_path), _ids("r1", "r2", "r3-a1"))
    assert reply["episode_ids"] == ["r1", "r2"]
    # Equal extras once, numbers summed over the workers.
    assert reply["exported_count"] == 2
    assert reply["manifest"]["participant_note"] == "in-test"


async def test_a_refusal_of_one_worker_crosses_typed_and_reopens_every_worker(cluster: Cluster) -> None:
    cluster.participants[102].close_error = InvalidPhase("worker 102 cannot close now")
    with pytest.raises(InvalidPhase, match="cannot close now"):
        await cluster.plane.prepare("c1", deadline())
    assert cluster.plane.phase == "idle"
    for pid, worker in cluster.workers.items():
        assert worker.admission.is_open, pid


async def test_restore_is_refused_once_a_worker_left(cluster: Cluster, tmp_path: Path) -> None:
    await cluster.lose(101)
    await cluster.worker(104)
    with pytest.raises(InvalidPhase, match="worker 101"):
        await cluster.plane.restore("r1", deadline(), str(tmp_path), _ids("e1"))
    assert len(cluster.plane.marks) == 0  # refused before anything was marked


async def test_restore_is_refused_once_a_worker_served(cluster: Cluster, tmp_path: Path) -> None:
    cluster.workers[102].admission.served = True  # what the worker's gate does at its first data request
    await wait_until(lambda: cluster.plane.admission.served, TIMEOUT, "the coordinator to hear of it")
    with pytest.raises(InvalidPhase, match="served"):
        await cluster.plane.restore("r1", deadline(), str(tmp_path), _ids("e1"))


async def _checkpoint(cluster: Cluster, directory: Path, *keys: str) -> None:
    cluster.participants[101].add(*keys)
    assert (await cluster.plane.prepare("c1", deadline()))["phase"] == "prepared"
    await cluster.plane.commit("c1", deadline(), str(directory), _ids(*keys))
    await cluster.plane.resume("c1", deadline())


async def test_a_restored_record_has_one_owner_the_worker_that_claims_it(tmp_path: Path) -> None:
    source = Cluster(3)
    target = Cluster(3)
    try:
        await source.start(101, 102, 103)
        await _checkpoint(source, tmp_path, "e1", "e2")
        await target.start(201, 202, 203)
        reply = await target.plane.restore("rs", deadline(), str(tmp_path), _ids("e1", "e2"))
        assert reply["restored"] == ["e1-a1", "e2-a1"]
        # Every worker refuses the checkpointed attempts; none installed anything yet.
        for worker in target.workers.values():
            assert worker.marks.is_retired("e1", 0) and worker.marks.is_retired("e2", 0)
        assert all(not p.called("install") for p in target.participants.values())
        assert await target.coordinator.participant.restored_pending() == {"e1-a1", "e2-a1"}
        assert await target.workers[202].claim(episode_id("e1", 1)) is True
        assert target.participants[202].episodes["e1-a1"]["step"] == 1
        with pytest.raises(AttemptRunning, match="worker 202"):
            await target.workers[203].claim(episode_id("e1", 1))
        assert await target.workers[203].claim(episode_id("e9", 1)) is False
        # Unclaimed e2-a1 is still the coordinator's: a commit exports it under its replacement attempt.
        await target.plane.resume("rs", deadline())
        assert (await target.plane.prepare("c2", deadline()))["phase"] == "prepared"
        again = tmp_path / "again"
        written = await target.plane.commit("c2", deadline(), str(again), _ids("e1-a1", "e2-a1"))
        assert written["episode_ids"] == ["e1-a1", "e2-a1"]
    finally:
        await source.aclose()
        await target.aclose()


async def test_retire_marks_every_worker_before_any_stops_and_replies_when_all_stopped(cluster: Cluster) -> None:
    gate = cluster.participants[101].retire_gate = Gate()
    retire = asyncio.ensure_future(cluster.plane.retire("x", deadline(), _ids("r1-a2")))
    await asyncio.wait_for(gate.entered.wait(), TIMEOUT)
    for pid, worker in cluster.workers.items():
        assert worker.marks.is_retired("r1", 2), pid
    await wait_until(lambda: all(cluster.participants[p].called("retire") for p in (102, 103)), TIMEOUT, "retires")
    assert not retire.done()  # worker 101 still stops its attempt
    gate.release()
    assert await asyncio.wait_for(retire, TIMEOUT) == {"retired_count": 1}
    late = await cluster.worker(104)
    assert late.marks.is_retired("r1", 2)  # a late registrant gets the marks in its snapshot
    await cluster.plane.forget("x", deadline(), ["r1"])
    for pid, worker in cluster.workers.items():
        assert worker.marks.retired_up_to("r1") is None, pid
        assert cluster.participants[pid].called("forgotten") == [{"rollout_ids": ["r1"]}]


async def test_ready_answers_from_memory_and_a_worker_that_never_reports_blocks_naming_it(cluster: Cluster) -> None:
    hold = asyncio.Event()

    async def stuck(checkpoint_id: str | None) -> None:
        await hold.wait()

    worker = cluster.workers[103]
    worker.participants.ready = stuck  # type: ignore[method-assign,assignment]
    reply = await cluster.plane.prepare("c9", deadline(1.0))
    assert reply["phase"] == "preparing"
    assert reply["report"]["worker_blockers"] == ["worker 103 has not reported its readiness for c9 yet"]
    # The hook never returns, yet the coordinator's ready does, from what the workers pushed: it never waits.
    async with asyncio.timeout(TIMEOUT):
        report = await cluster.coordinator.participant.ready("c9")
    assert report.blockers == () and report.worker_blockers == ("worker 103 has not reported its readiness for c9 yet",)
    hold.set()
    await cluster.plane.resume("c9", deadline())


class Verifier:
    """A third-party plugin on every worker: one record per episode it saw, tagged with its name by the worker."""

    def __init__(self, keys: tuple[str, ...] = ()) -> None:
        self.keys = keys
        self.installed: list[RestoredRecord] = []

    @hookimpl
    def export(self, checkpoint_id: str, scope: frozenset[str] | None) -> list[dict[str, Any]]:
        return [{"episode_id": wire(key), "verdict": "pass"} for key in self.keys]

    @hookimpl
    def install(self, checkpoint_id: str, manifest: Any, records: list[RestoredRecord]) -> None:
        self.installed.extend(records)


async def test_third_party_records_keep_their_owner_across_the_coordinator(tmp_path: Path) -> None:
    source = Cluster(2)
    target = Cluster(2)
    lacking = Cluster(2)
    try:
        await source.start()
        await source.worker(101, named={"verifier": Verifier(("e1",))})
        await source.worker(102, named={"verifier": Verifier()})
        await _checkpoint(source, tmp_path, "e1")
        records = [json.loads(line) for f in tmp_path.rglob("records-*.jsonl") for line in f.read_text().splitlines()]
        assert sorted(r.get("plugin", "own") for r in records) == ["own", "verifier"]

        verifiers = {pid: Verifier() for pid in (201, 202)}
        await target.start()
        for pid, verifier in verifiers.items():
            await target.worker(pid, named={"verifier": verifier})
        await target.plane.restore("rs", deadline(), str(tmp_path), _ids("e1"))
        assert await target.workers[202].claim(episode_id("e1", 1)) is True
        # Each plugin of the claiming worker gets its own record only.
        assert [r.record["verdict"] for r in verifiers[202].installed] == ["pass"]
        assert "verdict" not in target.participants[202].episodes["e1-a1"]
        assert verifiers[201].installed == []

        await lacking.start()
        await lacking.worker(301, named={"verifier": Verifier()})
        await lacking.worker(302)
        with pytest.raises(InvalidCheckpointState, match="worker 302"):
            await lacking.plane.restore("rs", deadline(), str(tmp_path), _ids("e1"))
    finally:
        for cluster in (source, target, lacking):
            await cluster.aclose()


async def test_records_cross_the_link_unchanged(cluster: Cluster, tmp_path: Path) -> None:
    cluster.participants[103].episodes["r1"] = {"episode_id": wire("r1"), "nan": math.nan, "big": 2**70, "neg": -0.0}
    assert (await cluster.plane.prepare("c1", deadline()))["phase"] == "prepared"
    await cluster.plane.commit("c1", deadline(), str(tmp_path), None)
    (records_file,) = tmp_path.rglob("records-*.jsonl")
    (record,) = [decode_line(line) for line in records_file.read_bytes().splitlines()]
    assert math.isnan(record["nan"]) and record["big"] == 2**70
    assert math.copysign(1.0, record["neg"]) == -1.0


async def test_a_failed_local_install_gives_the_record_back(tmp_path: Path) -> None:
    source = Cluster(2)
    target = Cluster(2)
    try:
        await source.start(101, 102)
        await _checkpoint(source, tmp_path, "e1", "e2")
        await target.start(201, 202)
        await target.plane.restore("rs", deadline(), str(tmp_path), _ids("e1", "e2"))
        target.participants[201].install_error = InvalidCheckpointState("worker 201 refuses it")
        with pytest.raises(InvalidCheckpointState, match="refuses"):
            await target.workers[201].claim(episode_id("e1", 1))
        assert await target.workers[202].claim(episode_id("e1", 1)) is True
        # A commit whose scope leaves the unclaimed e2-a1 out deletes it from the coordinator.
        await target.plane.resume("rs", deadline())
        assert (await target.plane.prepare("c2", deadline()))["phase"] == "prepared"
        await target.plane.commit("c2", deadline(), str(tmp_path / "again"), _ids("e1-a1"))
        await wait_until(lambda: target.coordinator.restored.pending() == set(), TIMEOUT, "e2-a1 deleted")
        assert await target.workers[201].claim(episode_id("e2", 1)) is False
    finally:
        await source.aclose()
        await target.aclose()


async def test_a_workers_plain_failure_fails_the_retire_naming_it(cluster: Cluster) -> None:

    async def broken(episode_ids: list[Any]) -> None:
        raise RuntimeError("cannot stop it")

    cluster.workers[102].participants.retire = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match=r"worker 102: .*cannot stop it"):
        await cluster.plane.retire("x", deadline(), _ids("r1"))
    for worker in cluster.workers.values():
        assert worker.marks.is_retired("r1", 0)  # the marks stay


class VersionedVerifier(Verifier):
    """The same verdicts exported as ``Versioned`` records (their functions never cross the link)."""

    @hookimpl
    def export(self, checkpoint_id: str, scope: frozenset[str] | None) -> list[Versioned]:
        return [
            Versioned(wire(key), 1, lambda key=key: {"episode_id": wire(key), "verdict": "pass"}) for key in self.keys
        ]


async def test_versioned_records_of_a_worker_are_built_before_they_cross_the_link(tmp_path: Path) -> None:
    # The built-in participants export Versioned records: a worker sends each one's record, tagged as the
    # writer would tag it, and the checkpoint holds it whole.
    source = Cluster(2)
    try:
        await source.start()
        await source.worker(101, named={"verifier": VersionedVerifier(("e1",))})
        await source.worker(102, named={"verifier": VersionedVerifier()})
        await _checkpoint(source, tmp_path, "e1")
        records = [json.loads(line) for f in tmp_path.rglob("records-*.jsonl") for line in f.read_text().splitlines()]
        verdicts = [r for r in records if r.get("plugin") == "verifier"]
        assert verdicts == [{"episode_id": wire("e1"), "verdict": "pass", "plugin": "verifier"}]
    finally:
        await source.aclose()


async def test_one_episodes_records_from_several_workers_are_one_record(tmp_path: Path) -> None:
    # A model server's calls of one episode answered by two workers: each exports the capture rows it owns.
    # The checkpoint holds one record of the episode (a restore refuses a capture key twice), rows of both.
    source = Cluster(3)
    target = Cluster(2)
    try:
        await source.start(101, 102, 103)
        source.participants[101].episodes["e1"] = {"episode_id": wire("e1"), "token_rows": [["c1", "one"]]}
        source.participants[102].episodes["e1"] = {
            "episode_id": wire("e1"),
            "token_rows": [["c2", "two"], ["c3", "three"]],
            "generation_cut": {"digest": "d"},
        }
        source.participants[103].add("e2")
        assert (await source.plane.prepare("c1", deadline()))["phase"] == "prepared"
        reply = await source.plane.commit("c1", deadline(), str(tmp_path), _ids("e1", "e2"))
        assert reply["episode_ids"] == ["e1", "e2"]
        await source.plane.resume("c1", deadline())

        await target.start(201, 202)
        assert (await target.plane.restore("rs", deadline(), str(tmp_path), _ids("e1", "e2")))["restored"] == [
            "e1-a1",
            "e2-a1",
        ]
        assert await target.workers[202].claim(episode_id("e1", 1)) is True
        (installed,) = target.participants[202].called("install")[0]["records"]
        assert installed.record["token_rows"] == [["c1", "one"], ["c2", "two"], ["c3", "three"]]
        assert installed.record["generation_cut"] == {"digest": "d"}

        # Records of one episode that disagree fail the export, naming it: never a checkpoint a restore refuses.
        source.participants[101].episodes["e1"]["generation_cut"] = {"digest": "other"}
        assert (await source.plane.prepare("c2", deadline()))["phase"] == "prepared"
        with pytest.raises(ExportFailed, match=r"e1.*generation_cut"):
            await source.plane.commit("c2", deadline(), str(tmp_path / "c2"), _ids("e1"))
    finally:
        await source.aclose()
        await target.aclose()


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


async def test_the_metrics_are_the_workers_gates_summed_and_keep_what_a_lost_worker_counted(cluster: Cluster) -> None:
    # The main process has no gate: its plane's metrics ask every worker for its gate's figures at each scrape.
    cluster.coordinator.watch_metrics(cluster.plane.telemetry.metrics)

    async def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return _samples(await cluster.plane.telemetry.scrape(lambda: cluster.plane.participants.ready(None)))

    figures = {101: (1, 2, [0.004, 0.2]), 102: (2, 0, [7.0]), 103: (0, 1, [])}
    for pid, (parked, refused, waits) in figures.items():
        gate = cluster.workers[pid].gate
        gate.parked, gate.refused = parked, refused
        for seconds in waits:
            gate.parks += 1
            assert gate.observe_park is not None
            gate.observe_park(seconds)
    samples = await scrape()
    assert samples[("gym_checkpoint_parked_requests", ())] == 3
    assert samples[("gym_checkpoint_refused_requests_total", ())] == 3
    assert samples[("gym_checkpoint_parked_duration_seconds_count", ())] == 3
    assert samples[("gym_checkpoint_parked_duration_seconds_sum", ())] == pytest.approx(7.204)
    buckets = {"0.005": 1, "0.25": 2, "5.0": 2, "10.0": 3, "+Inf": 3}
    for bound, count in buckets.items():
        assert samples[("gym_checkpoint_parked_duration_seconds_bucket", (("le", bound),))] == count, bound

    # A worker that left: its requests parked are gone, what it counted stays (counters never go down).
    await cluster.lose(102)
    samples = await scrape()
    assert samples[("gym_checkpoint_parked_requests", ())] == 1
    assert samples[("gym_checkpoint_parked_duration_seconds_count", ())] == 3
    # A worker whose answer is not understood counts with its last one.
    cluster.workers[103].gate.refused = -1
    cluster.workers[101].gate.refused = 5
    samples = await scrape()
    assert samples[("gym_checkpoint_refused_requests_total", ())] == 5 + 0 + 1
