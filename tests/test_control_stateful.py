"""Random sequences of control operations, crashes and restores against one control plane.

A hypothesis state machine drives a participant's control routes over HTTP (in process)
with prepare, commit, resume, restore, retire, forget, renew, new episodes, restarts,
blocked prepares, readiness regressing between prepare and commit, writes that fail (and
their retries, into the same or another directory), id lists at the body limit (a small
``BodyLimits`` keeps them cheap), deadlines in milliseconds, and crashes (the process state
is dropped and a fresh plane starts over the same checkpoint directories). A small model of
docs/protocol.md ("Phases", "Retire, forget, restore marks", "Restarts", "Errors") predicts every
reply; after every step the
invariants are checked: phase and admission never disagree, the status matches the
model, marks only rise until forgotten, and no reply is a 500.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
from control_support import FailingStorage, Harness, close_harness, make_harness, wait_until, wire
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nemo_gym_checkpoint_plugin._identity import EpisodeId, from_capture_key
from nemo_gym_checkpoint_plugin._routes import BodyLimits

ROLLOUTS = ("r0", "r1", "r2")
CHECKPOINT_IDS = tuple(f"c{i}" for i in range(16))
ATTEMPTS = st.integers(min_value=0, max_value=3)
# Every refusal's documented status (docs/protocol.md "Errors").
STATUS_OF = {
    "stale_checkpoint": 409,
    "checkpoint_conflict": 409,
    "invalid_phase": 409,
    "restart_in_scope": 409,
    "export_failed": 409,
    "invalid_checkpoint_state": 422,
}
# A prepare that must wait on a blocker gets this long (real time) before it replies "preparing".
# The plane's clock is frozen, so a deadline this short never passes before the call arrives.
BLOCKED_PREPARE_SECONDS = 0.05
# The machine's body limit: small, so lists at and over it cost nothing.
LIMITS = BodyLimits(max_ids=6)


def key_of(rollout_id: str, attempt: int) -> str:
    return EpisodeId(rollout_id=rollout_id, attempt=attempt).capture_key


@dataclass
class Model:
    """What docs/protocol.md says one participant process must hold."""

    phase: str = "idle"
    active: str | None = None
    operation: str | None = None  # "checkpoint" or "restore"
    resumed: set[str] = field(default_factory=set)
    marks: dict[str, int] = field(default_factory=dict)
    prepare_reply: dict[str, Any] | None = None
    commit: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    restore: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    reported_restarts: set[str] = field(default_factory=set)
    export_failed: bool = False
    # After a write that failed: the scope of that commit, and the capture keys its export holds.
    failed_write: tuple[tuple[str, ...] | None] | None = None
    kept: list[str] = field(default_factory=list)
    # The in-test participant's own state (control_support.Participant).
    held: set[str] = field(default_factory=set)
    pending: set[str] = field(default_factory=set)
    restarts: set[str] = field(default_factory=set)

    def is_marked(self, key: str) -> bool:
        episode = from_capture_key(key)
        return episode.attempt <= self.marks.get(episode.rollout_id, -1)

    def mark(self, key: str) -> None:
        episode = from_capture_key(key)
        self.marks[episode.rollout_id] = max(self.marks.get(episode.rollout_id, -1), episode.attempt)

    def fence(self, checkpoint_id: str) -> str | None:
        """The refusal code ``_fence`` gives, if any (stale first, then another active id)."""
        if checkpoint_id in self.resumed:
            return "stale_checkpoint"
        if self.active is not None and self.active != checkpoint_id:
            return "checkpoint_conflict"
        return None

    def back_to_idle(self) -> None:
        self.phase, self.active, self.operation = "idle", None, None
        self.prepare_reply = self.commit = self.restore = None
        self.reported_restarts = set()
        self.export_failed = False
        self.failed_write, self.kept = None, []


class ControlPlaneMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.tmp = tempfile.TemporaryDirectory(prefix="ng-ckpt-stateful-")
        self.generation = 0
        self.model = Model()
        # Published checkpoints on disk (they outlive crashes): directory -> (source id, keys written).
        self.published: dict[str, tuple[str, list[str]]] = {}
        self.now = time.time()  # the planes' clock: frozen (deadlines are relative to it)
        self.h: Harness = self.new_harness()

    def new_harness(self) -> Harness:
        self.storage = FailingStorage()
        return self.run(make_harness(Path(self.tmp.name), clock=lambda: self.now, storage=self.storage, limits=LIMITS))

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        try:
            self.run(close_harness(self.h))
        finally:
            self.loop.close()
            self.tmp.cleanup()

    # -- calling the routes ------------------------------------------------------------------------

    def post(self, route: str, *, seconds: float = 10.0, **body: Any) -> tuple[int, dict[str, Any]]:
        body["deadline_ts"] = self.now + seconds
        response = self.run(self.h.post(route, body))
        assert response.status_code != 500, (route, body, response.text)
        return response.status_code, response.json()

    def expect(self, route: str, code: str | None, *, seconds: float = 10.0, **body: Any) -> dict[str, Any]:
        """Call ``route``; ``code`` None expects a 200, else that refusal with its documented status."""
        status, payload = self.post(route, seconds=seconds, **body)
        if code is None:
            assert status == 200, (route, body, status, payload)
            return payload
        assert status == STATUS_OF[code] and payload["error"]["code"] == code, (route, body, status, payload)
        return payload

    def pick_id(self, data: st.DataObject, *, starts: bool = False) -> str:
        """A checkpoint id: mostly the active one, or for an operation that ``starts`` one an unused one.

        Any id stays possible, so fencing is exercised; the bias lets sequences get past it.
        """
        active = self.model.active
        favoured = [active] * 20 if active is not None else []
        if starts:
            favoured += [c for c in CHECKPOINT_IDS if c not in self.model.resumed and c != active][:1] * 20
        return data.draw(st.sampled_from([*favoured, *CHECKPOINT_IDS]), label="checkpoint_id")

    def unused_id(self) -> str | None:
        """The first checkpoint id this process has not resumed (None once all were)."""
        return next((c for c in CHECKPOINT_IDS if c not in self.model.resumed), None)

    def commit_dir(self, checkpoint_id: str) -> str:
        return str(Path(self.tmp.name) / f"gen{self.generation}-{checkpoint_id}")

    # -- episodes the participant holds ------------------------------------------------------------

    @initialize(keys=st.sets(st.builds(key_of, st.sampled_from(ROLLOUTS), ATTEMPTS), min_size=1, max_size=4))
    def episodes_in_flight(self, keys: set[str]) -> None:
        self.h.participant.add(*keys)
        self.model.held |= keys

    @rule(rollout_id=st.sampled_from(ROLLOUTS), attempt=ATTEMPTS)
    def new_episode(self, rollout_id: str, attempt: int) -> None:
        key = key_of(rollout_id, attempt)
        if self.model.is_marked(key):
            return  # the gate refuses a retired attempt's work: it never reaches the participant
        self.h.participant.add(key)
        self.model.held.add(key)

    @precondition(lambda self: self.model.phase == "idle")
    @rule(data=st.data())
    def declare_restart(self, data: st.DataObject) -> None:
        # An episode becomes a restart only while no checkpoint is open (docs/protocol.md "Episode steps").
        if not self.model.held:
            return
        key = data.draw(st.sampled_from(sorted(self.model.held)))
        self.h.participant.restarts.add(key)
        self.model.restarts.add(key)

    # -- the checkpoint path -----------------------------------------------------------------------

    @rule(blocked=st.sampled_from([False, False, False, True]), data=st.data())
    def prepare(self, blocked: bool, data: st.DataObject) -> None:
        self.do_prepare(self.pick_id(data, starts=True), blocked)

    def do_prepare(self, checkpoint_id: str, blocked: bool) -> None:
        m = self.model
        code = m.fence(checkpoint_id)
        if code is None and m.operation == "restore":
            code = "invalid_phase"
        if code is not None:
            self.expect("prepare", code, checkpoint_id=checkpoint_id)
            return
        if m.active is None:
            if blocked and m.held:
                self.h.participant.blockers.add(sorted(m.held)[0])
        waits = bool(self.h.participant.blockers)
        reply = self.expect(
            "prepare", None, seconds=BLOCKED_PREPARE_SECONDS if waits else 10.0, checkpoint_id=checkpoint_id
        )
        if m.active is None:
            m.active, m.operation = checkpoint_id, "checkpoint"
        if waits:
            # Reached its deadline waiting: 200 with its blockers, admission stays closed.
            assert m.phase in ("idle", "preparing"), m.phase
            m.phase = "preparing"
            assert reply["phase"] == "preparing" and reply["report"]["ready"] is False
            assert reply["report"]["blockers"] == sorted(self.h.participant.blockers)
            return
        if m.prepare_reply is None:
            m.phase = "prepared"
            assert reply["phase"] == "prepared" and reply["report"]["ready"] is True
            assert sorted(reply["report"]["restarts"]) == sorted(m.restarts)
            m.prepare_reply, m.reported_restarts = reply, set(m.restarts)
        else:
            assert reply == m.prepare_reply  # a completed prepare is replayed as it was

    @precondition(lambda self: self.model.phase == "preparing")
    @rule()
    def blocker_clears(self) -> None:
        for key in list(self.h.participant.blockers):
            self.h.participant.unblock(key)
        self.run(wait_until(lambda: self.h.plane.phase.value == "prepared", what="prepared"))
        self.model.phase = "prepared"
        self.model.reported_restarts = set(self.model.restarts)
        # The prepare reply is remembered now: a retry of the prepare replays it.
        self.model.prepare_reply = self.expect("prepare", None, checkpoint_id=self.model.active)

    def draw_scope(self, data: st.DataObject, everything: bool) -> list[str] | None:
        """A commit scope: None (everything held), or some of the held episodes, restarts and others."""
        if everything:
            return None
        candidates = sorted(self.model.held | self.model.restarts | {key_of("r0", 0)})
        return sorted(data.draw(st.sets(st.sampled_from(candidates), max_size=4), label="scope"))

    @rule(everything=st.booleans(), elsewhere=st.booleans(), data=st.data())
    def commit(self, everything: bool, elsewhere: bool, data: st.DataObject) -> None:
        self.do_commit(self.pick_id(data), self.draw_scope(data, everything), elsewhere=elsewhere)

    def do_commit(self, checkpoint_id: str, scope: list[str] | None, *, elsewhere: bool = False) -> None:
        m = self.model
        directory = self.commit_dir(checkpoint_id) + ("-elsewhere" if elsewhere else "")
        body = {
            "checkpoint_id": checkpoint_id,
            "checkpoint_dir": directory,
            "episode_ids": None if scope is None else [wire(k) for k in scope],
        }
        args = (directory, None if scope is None else tuple(scope))
        code = m.fence(checkpoint_id)
        if code is None and (m.active is None or m.operation != "checkpoint"):
            code = "invalid_phase"
        if code is None and m.export_failed:
            code = "export_failed"  # every later commit of the id, whatever its arguments
        if code is None and m.commit is not None:
            code = None if m.commit[0] == args else "checkpoint_conflict"
            if code is None:
                assert self.expect("commit", None, **body) == m.commit[1]  # replayed, never exported twice
                return
        retry = code is None and m.failed_write is not None
        if retry and m.failed_write != args[1:]:
            code = "checkpoint_conflict"  # after a failed write only the directory may differ
        if code is None and not retry and m.phase != "prepared":
            code = "invalid_phase"
        if code is None and not retry and scope is not None and set(scope) & m.reported_restarts:
            code = "restart_in_scope"
        if code is None and not retry and self.h.participant.blockers:
            code = "export_failed"  # readiness regressed since prepare: final
            m.export_failed = True
        if code is not None:
            self.expect("commit", code, **body)
            return
        exports_before = len(self.h.participant.called("export"))
        reply = self.expect("commit", None, **body)
        exported = {k for k in m.held if k not in m.restarts and (scope is None or k in scope)}
        if retry:
            event("a failed write retried" + (" elsewhere" if elsewhere else " in place"))
            exported = set(m.kept)  # the export kept from the failed write, whatever changed since
            assert len(self.h.participant.called("export")) == exports_before
            assert self.storage.consumed[-1] == self.stored(directory)
            m.failed_write, m.kept = None, []
        else:
            assert len(self.h.participant.called("export")) == exports_before + 1
        event("commit wrote records" if exported else "commit wrote no records")
        assert reply["phase"] == "committed"
        assert reply["episode_ids"] == sorted(exported)
        assert reply["manifest"]["checkpoint_id"] == checkpoint_id
        assert reply["manifest"]["record_count"] == len(exported)
        if scope is not None:
            # Restored episodes the scope leaves out are deleted (delete_restored).
            dropped = m.pending - set(scope)
            m.held -= dropped
            m.pending -= dropped
        m.phase, m.commit = "committed", (args, reply)
        self.published[directory] = (checkpoint_id, sorted(exported))

    def stored(self, directory: str) -> list[dict[str, Any]]:
        participant_dir = Path(directory) / "gym" / "environment" / "env_one"
        (records,) = participant_dir.glob("records-*.jsonl")
        return [json.loads(line) for line in records.read_text().splitlines()]

    def can_start_commit(self) -> bool:
        m = self.model
        return m.phase == "prepared" and m.commit is None and not m.export_failed

    @precondition(lambda self: self.can_start_commit())
    @rule(everything=st.booleans(), elsewhere=st.booleans(), data=st.data())
    def a_write_that_fails(self, everything: bool, elsewhere: bool, data: st.DataObject) -> None:
        """The disk is full: invalid_checkpoint_state, the export is kept for a retry (even a failed one)."""
        m = self.model
        scope = self.draw_scope(data, everything) if m.failed_write is None else m.failed_write[0]
        scope = None if scope is None else list(scope)
        if m.failed_write is None and (
            (scope is not None and set(scope) & m.reported_restarts) or self.h.participant.blockers
        ):
            return
        directory = self.commit_dir(m.active) + ("-elsewhere" if elsewhere else "")
        episode_ids = None if scope is None else [wire(k) for k in scope]
        self.storage.fail_writes = 1
        exports_before = len(self.h.participant.called("export"))
        error = self.expect(
            "commit",
            "invalid_checkpoint_state",
            checkpoint_id=m.active,
            checkpoint_dir=directory,
            episode_ids=episode_ids,
        )["error"]
        assert self.storage.fail_writes == 0 and "no space left" in error["detail"]
        written = sorted(k for k in m.held if k not in m.restarts and (scope is None or k in scope))
        if m.failed_write is None:
            assert len(self.h.participant.called("export")) == exports_before + 1
            m.failed_write, m.kept = (None if scope is None else tuple(scope),), written
        else:
            event("a retried write failed again")
            assert len(self.h.participant.called("export")) == exports_before
        keys = [EpisodeId.model_validate(r["episode_id"]).capture_key for r in self.storage.consumed[-1]]
        assert keys == m.kept
        assert not Path(directory).exists()  # nothing published; the phase stays prepared

    @precondition(lambda self: self.model.phase == "prepared" and self.model.commit is None)
    @rule(everything=st.booleans(), data=st.data())
    def readiness_regresses_before_the_commit(self, everything: bool, data: st.DataObject) -> None:
        """A blocker appears after prepare: a commit that has not exported yet ends the checkpoint for good."""
        m = self.model
        self.h.participant.blockers.add(sorted(m.held)[0] if m.held else key_of("r0", 0))
        try:
            scope = self.draw_scope(data, everything) if m.failed_write is None else m.failed_write[0]
            self.do_commit(m.active, None if scope is None else list(scope))
        finally:
            self.h.participant.blockers.clear()  # readiness recovers: a retry must still not commit

    @precondition(lambda self: self.model.phase == "prepared" and self.model.commit is None)
    @rule(everything=st.booleans(), data=st.data())
    def an_export_that_fails(self, everything: bool, data: st.DataObject) -> None:
        """The participant's export raises: this commit and every later one of the id get export_failed."""
        m = self.model
        if m.failed_write is not None:
            return  # the export already succeeded; a commit now retries its write
        scope = self.draw_scope(data, everything)
        if scope is not None and set(scope) & m.reported_restarts:
            return
        directory = self.commit_dir(m.active)
        self.h.participant.export_error = RuntimeError("the sandbox vanished")
        try:
            episode_ids = None if scope is None else [wire(k) for k in scope]
            self.expect(
                "commit", "export_failed", checkpoint_id=m.active, checkpoint_dir=directory, episode_ids=episode_ids
            )
        finally:
            self.h.participant.export_error = None
        m.export_failed = True  # the phase stays prepared; nothing was published

    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        self.do_resume(self.pick_id(data))

    def do_resume(self, checkpoint_id: str) -> None:
        m = self.model
        if checkpoint_id in m.resumed or m.active is None:
            reply = self.expect("resume", None, checkpoint_id=checkpoint_id)
            assert reply == {"phase": m.phase, "idempotent": True}
            m.resumed.add(checkpoint_id)
            return
        if m.active != checkpoint_id:
            self.expect("resume", "checkpoint_conflict", checkpoint_id=checkpoint_id)
            return
        self.h.participant.blockers.clear()
        assert self.expect("resume", None, checkpoint_id=checkpoint_id) == {"phase": "idle", "idempotent": False}
        m.resumed.add(checkpoint_id)
        m.back_to_idle()

    @precondition(lambda self: self.model.phase == "idle")
    @rule(everything=st.booleans(), resume=st.booleans(), data=st.data())
    def a_whole_checkpoint(self, everything: bool, resume: bool, data: st.DataObject) -> None:
        """What a controller does most: prepare, commit and (usually) resume an id never used."""
        fresh = self.unused_id()
        if fresh is None:
            return
        self.do_prepare(fresh, blocked=False)
        self.do_commit(fresh, self.draw_scope(data, everything))
        if resume:
            self.do_resume(fresh)

    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        checkpoint_id = self.pick_id(data)
        m = self.model
        code = m.fence(checkpoint_id) or (None if m.active is not None else "invalid_phase")
        reply = self.expect("renew", code, checkpoint_id=checkpoint_id)
        if code is None:
            assert reply["lease_expires_at"] == self.h.plane.lease.expires_at

    # -- restore, retire, forget -------------------------------------------------------------------

    @precondition(lambda self: bool(self.published))
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        self.do_restore(self.pick_id(data, starts=True), data)

    @precondition(lambda self: bool(self.published) and self.model.phase == "idle")
    @rule(resume=st.booleans(), data=st.data())
    def a_whole_restore(self, resume: bool, data: st.DataObject) -> None:
        """After a crash, or into a live process: restore with an id never used, then (usually) resume."""
        fresh = self.unused_id()
        if fresh is None:
            return
        self.do_restore(fresh, data)
        if resume and self.model.phase == "restored":
            self.do_resume(fresh)

    @precondition(lambda self: bool(self.published) and self.model.phase == "idle")
    @rule(data=st.data())
    def a_restore_whose_install_fails(self, data: st.DataObject) -> None:
        """The participant refuses a record: invalid_checkpoint_state, nothing half-installed, marks kept."""
        fresh = self.unused_id()
        if fresh is None:
            return
        self.h.participant.install_error = ValueError("a record this participant cannot take")
        try:
            self.do_restore(fresh, data, install_fails=True)
        finally:
            self.h.participant.install_error = None

    def do_restore(self, checkpoint_id: str, data: st.DataObject, *, install_fails: bool = False) -> None:
        m = self.model
        directory = data.draw(st.sampled_from(sorted(self.published)), label="checkpoint_dir")
        source, written = self.published[directory]
        extra = st.builds(key_of, st.sampled_from(ROLLOUTS), ATTEMPTS)
        # Mostly the keys written there (what a controller restores), sometimes others.
        keys = st.sampled_from(written) | st.sampled_from(written) | extra if written else extra
        scope = sorted(data.draw(st.sets(keys, min_size=1, max_size=4), label="scope"))
        body = {"checkpoint_id": checkpoint_id, "checkpoint_dir": directory, "episode_ids": [wire(k) for k in scope]}
        args = (directory, tuple(scope))
        code = m.fence(checkpoint_id)
        if code is None and m.operation == "checkpoint":
            code = "invalid_phase"
        if code is None and m.restore is not None:
            if m.restore[0] == args:
                assert self.expect("restore", None, **body) == m.restore[1]
                return
            code = "checkpoint_conflict"
        if code is not None:
            self.expect("restore", code, **body)
            return
        for key in scope:  # marks first, whatever happens next
            m.mark(key)
        read = [k for k in written if k in scope]
        replacements = sorted(
            EpisodeId(rollout_id=e.rollout_id, attempt=e.attempt + 1).capture_key for e in map(from_capture_key, read)
        )
        if install_fails:
            self.expect("restore", "invalid_checkpoint_state", **body)
            # The checkpointed attempts were retired before the install; what it left is deleted.
            m.held -= set(read) | set(replacements)
            m.pending -= set(replacements)
            return  # back to idle (the phase invariant checks it)
        reply = self.expect("restore", None, **body)
        event("restore installed" if replacements else "restore of nothing held")
        if set(read) & m.held:
            event("restore into a process still holding a checkpointed attempt")
        assert reply == {"phase": "restored", "source_checkpoint_id": source, "restored": replacements}
        # The checkpointed attempts read are retired in this process, then replaced.
        m.held = (m.held - set(read)) | set(replacements)
        m.pending |= set(replacements)
        m.phase, m.active, m.operation, m.restore = "restored", checkpoint_id, "restore", (args, reply)

    @precondition(lambda self: bool(self.published))
    @rule(data=st.data())
    def restore_from_a_directory_without_a_manifest(self, data: st.DataObject) -> None:
        checkpoint_id = self.pick_id(data, starts=True)
        m = self.model
        directory = str(Path(self.tmp.name) / "never-committed")
        scope = [key_of("r1", 0)]
        body = {"checkpoint_id": checkpoint_id, "checkpoint_dir": directory, "episode_ids": [wire(k) for k in scope]}
        code = m.fence(checkpoint_id)
        if code is None and m.active is not None:
            code = "invalid_phase" if m.operation == "checkpoint" else "checkpoint_conflict"
        if code is None:
            code = "invalid_checkpoint_state"
            m.mark(scope[0])  # the marks stay after a failed read; the plane goes back to idle
        self.expect("restore", code, **body)

    def marks_allowed(self, checkpoint_id: str) -> str | None:
        m = self.model
        if m.phase in ("preparing", "prepared", "committed"):
            return "invalid_phase"
        if m.phase == "restored" and checkpoint_id != m.active:
            return "checkpoint_conflict"
        return None

    def key_pool(self) -> st.SearchStrategy[str]:
        pool = st.builds(key_of, st.sampled_from(ROLLOUTS), ATTEMPTS)
        return st.sampled_from(sorted(self.model.held)) | pool if self.model.held else pool

    @rule(data=st.data())
    def retire(self, data: st.DataObject) -> None:
        self.do_retire(self.pick_id(data), sorted(data.draw(st.sets(self.key_pool(), min_size=1, max_size=3))))

    def do_retire(self, checkpoint_id: str, keys: list[str]) -> None:
        m = self.model
        body = {"checkpoint_id": checkpoint_id, "episode_ids": [wire(k) for k in keys]}
        code = self.marks_allowed(checkpoint_id)
        reply = self.expect("retire", code, **body)
        if code is not None:
            return  # a refused retire marks nothing (the marks invariant checks it)
        assert reply == {"retired_count": len(keys)}
        for key in keys:
            m.mark(key)
        m.held -= set(keys)
        assert not set(keys) & set(self.h.participant.episodes)

    def refused_body(self, route: str, field: str, **body: Any) -> None:
        """A body error (422 ``{"detail": [...]}`` naming ``field``): nothing reaches the plane."""
        body.setdefault("deadline_ts", self.now + 10)
        response = self.run(self.h.post(route, body))
        assert response.status_code == 422, (route, response.status_code, response.text)
        assert [e["loc"] for e in response.json()["detail"]] == [["body", field]], response.text

    @rule(over=st.booleans(), data=st.data())
    def a_retire_at_the_id_limit(self, over: bool, data: st.DataObject) -> None:
        """A list of exactly the limit is a retire like any other; one more id is refused before the plane."""
        n = LIMITS.max_ids + over
        keys = data.draw(st.lists(self.key_pool(), min_size=n, max_size=n), label="keys")
        checkpoint_id = self.pick_id(data)
        if over:
            self.refused_body("retire", "episode_ids", checkpoint_id=checkpoint_id, episode_ids=[wire(k) for k in keys])
            return
        event("a retire at the id limit")
        self.do_retire(checkpoint_id, keys)

    @rule(route=st.sampled_from(["commit", "restore", "forget"]), data=st.data())
    def a_list_over_the_id_limit(self, route: str, data: st.DataObject) -> None:
        n = LIMITS.max_ids + 1
        checkpoint_id = self.pick_id(data)
        if route == "forget":
            self.refused_body(route, "rollout_ids", checkpoint_id=checkpoint_id, rollout_ids=["r0"] * n)
            return
        keys = data.draw(st.lists(self.key_pool(), min_size=n, max_size=n), label="keys")
        self.refused_body(
            route,
            "episode_ids",
            checkpoint_id=checkpoint_id,
            checkpoint_dir=self.commit_dir("x"),
            episode_ids=[wire(k) for k in keys],
        )

    @rule(route=st.sampled_from(["prepare", "renew", "resume", "commit", "retire", "forget"]), data=st.data())
    def a_deadline_in_milliseconds(self, route: str, data: st.DataObject) -> None:
        """Refused on the plane's (frozen) clock before anything changes, whatever the phase."""
        body: dict[str, Any] = {"checkpoint_id": self.pick_id(data), "deadline_ts": self.now * 1000}
        if route == "commit":
            body.update(checkpoint_dir=self.commit_dir("x"), episode_ids=None)
        if route == "retire":
            body["episode_ids"] = [wire(key_of("r0", 0))]
        if route == "forget":
            body["rollout_ids"] = ["r0"]
        self.refused_body(route, "deadline_ts", **body)

    @rule(rollouts=st.sets(st.sampled_from(ROLLOUTS), min_size=1), data=st.data())
    def forget(self, rollouts: set[str], data: st.DataObject) -> None:
        checkpoint_id = self.pick_id(data)
        code = self.marks_allowed(checkpoint_id)
        reply = self.expect("forget", code, checkpoint_id=checkpoint_id, rollout_ids=sorted(rollouts))
        if code is None:
            assert reply == {"forgotten_count": len(rollouts)}
            for rollout_id in rollouts:
                self.model.marks.pop(rollout_id, None)

    # -- crashes -----------------------------------------------------------------------------------

    @rule()
    def crash(self) -> None:
        """The process dies: everything in memory is gone; what was published on disk stays."""
        self.run(close_harness(self.h))
        self.generation += 1
        self.h = self.new_harness()
        self.model = Model()

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def phase_and_admission_agree_with_the_model(self) -> None:
        plane, m = self.h.plane, self.model
        assert plane.phase.value == m.phase
        assert plane.checkpoint_id == m.active
        # Phase and admission never disagree: open exactly when idle.
        assert plane.admission.is_open == (m.phase == "idle")

    @invariant()
    def marks_agree_with_the_model(self) -> None:
        marks = self.h.plane.marks
        assert len(marks) == len(self.model.marks)
        for rollout_id in ROLLOUTS:
            assert marks.retired_up_to(rollout_id) == self.model.marks.get(rollout_id)

    @invariant()
    def status_agrees_with_the_model(self) -> None:
        status = self.run(self.h.status())
        assert status["phase"] == self.model.phase
        assert status["checkpoint_id"] == self.model.active
        assert status["retired_rollouts"] == len(self.model.marks)

    @invariant()
    def the_participant_holds_what_the_model_says(self) -> None:
        assert set(self.h.participant.episodes) == self.model.held
        assert self.h.participant.pending == self.model.pending


ControlPlaneMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestControlPlaneStateMachine = ControlPlaneMachine.TestCase
