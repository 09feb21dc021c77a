"""The controller's view of a deployment and the coordinated operations on it.

A ``Coordinator`` holds the participants ``discover`` found and a reserved
control pool. Each operation builds its body once, sends the same bytes to the
participants stage by stage in the coordination order (``_order.stages_for``),
and either returns what the participants replied or raises one
``CoordinationError`` naming every failing server and its code.

Every call is bounded by the operation's deadline plus ``reply_grace`` (the
participant replies at its deadline at the latest; the grace covers the trip).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidCheckpointState
from .._gc_pause import heap_frozen
from .._storage.index import check_participants_index, write_participants_index
from .._storage.occupied import other_checkpoints
from .._storage.retention import hold_lease
from ._discovery import Participant
from ._errors import BAD_REPLY, INCONSISTENT_CHECKPOINT, CoordinationError, ParticipantFailure
from ._order import stages_for
from ._ownership import OwnershipMixin
from ._results import CommitResult, PrepareResult, RestoreResult, capture_key, created_replacements, wire_episode_id
from ._telemetry import call_outcome as _call_outcome
from ._telemetry import call_span as _call_span
from ._telemetry import operation_outcome as _operation_outcome
from ._telemetry import operation_span as _operation_span
from ._transport import CallFailed, ControlTransport, Endpoint, encode_body

__all__ = ["Coordinator", "Progress", "DEFAULT_TIMEOUT"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0


@dataclass(frozen=True)
class Progress:
    """One participant's reply in a fan-out, for progress displays: ``done`` of ``total`` so far."""

    operation: str
    participant: Participant
    done: int
    total: int
    elapsed: float
    failure: ParticipantFailure | None = None
    reply: dict[str, Any] | None = None


ProgressCallback = Callable[[Progress], None]


class Coordinator(OwnershipMixin):
    """Participants of one deployment, and the operations of docs/protocol.md's coordination order.

    Use it as an async context manager (or call ``close``) to release the control pool.
    ``failures`` and ``non_participants`` are what discovery reported besides participants.
    ``owner`` (None: none) is sent in every call but ``status`` (``_ownership.py``: ``claim``, ``release``).
    """

    def __init__(
        self,
        participants: Sequence[Participant],
        transport: ControlTransport,
        *,
        pm: Any = None,
        reply_grace: float = 10.0,
        cleanup_timeout: float = 30.0,
        failures: Sequence[ParticipantFailure] = (),
        non_participants: Sequence[Endpoint] = (),
    ) -> None:
        self.participants = list(participants)
        self.transport = transport
        self.pm = pm
        self.reply_grace = reply_grace
        self.cleanup_timeout = cleanup_timeout
        self.failures = list(failures)
        self.non_participants = list(non_participants)
        self.progress: ProgressCallback | None = None
        self.owner: str | None = None

    async def close(self) -> None:
        await self.transport.close()

    async def __aenter__(self) -> Coordinator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- fan-out machinery ---------------------------------------------------------------------

    def _stages(self, operation: str) -> list[list[Participant]]:
        stages = []
        for kinds in stages_for(self.pm, operation):
            members = [p for p in self.participants if p.kind in kinds]
            if members:
                stages.append(members)
        return stages

    @staticmethod
    def _deadline(deadline_ts: float | None, timeout: float | None) -> float:
        if deadline_ts is not None:
            return float(deadline_ts)
        return time.time() + (DEFAULT_TIMEOUT if timeout is None else timeout)

    async def _call_stage(
        self,
        operation: str,
        members: Sequence[Participant],
        body: bytes | None,
        timeout: float,
        counter: list[int],
        total: int,
    ) -> tuple[dict[str, dict[str, Any]], list[ParticipantFailure]]:
        """Call every member at once; collect replies and failures (never raises for a member)."""

        async def one(participant: Participant) -> tuple[Participant, dict[str, Any] | ParticipantFailure]:
            started = time.monotonic()
            # A child of the operation's span per participant call (none for status probes); its traceparent
            # rides on the call, so the participant's spans join this trace (docs/telemetry.md).
            with _call_span(operation, participant) as current:
                try:
                    outcome: dict[str, Any] | ParticipantFailure = await self.transport.call(
                        participant.endpoint, operation, body, timeout=timeout
                    )
                except CallFailed as exc:
                    outcome = exc.failure
                _call_outcome(current, outcome)
            counter[0] += 1
            if self.progress is not None:
                failure, reply = (outcome, None) if isinstance(outcome, ParticipantFailure) else (None, outcome)
                self.progress(
                    Progress(
                        operation,
                        participant,
                        counter[0],
                        total,
                        time.monotonic() - started,
                        failure=failure,
                        reply=reply,
                    )
                )
            return participant, outcome

        replies: dict[str, dict[str, Any]] = {}
        failures: list[ParticipantFailure] = []
        for participant, outcome in await asyncio.gather(*(one(p) for p in members)):
            if isinstance(outcome, ParticipantFailure):
                failures.append(outcome)
            else:
                replies[participant.name] = outcome
        return replies, failures

    async def _run(
        self,
        operation: str,
        payload: dict[str, Any] | None,
        deadline_ts: float,
        *,
        stop: Callable[[dict[str, dict[str, Any]], list[ParticipantFailure]], bool] | None = None,
        keep_going: bool = False,
    ) -> tuple[dict[str, dict[str, Any]], list[ParticipantFailure], list[str], list[str] | None]:
        """Run the stages of ``operation``; ``stop`` decides after each stage whether to go on.

        The body is encoded once and the same bytes go to every participant. With
        ``keep_going`` (resume, retire, forget: operations that go on past failures), a stage
        that starts with less than half of the operation's time left gets a fresh deadline
        of the full time (the one body re-encoded for the stages left), so a participant
        that hung until the deadline cannot make every later stage fail with
        ``deadline_exceeded``.

        Returns replies, failures, the names never reached, and the kinds of the stage it stopped at.
        """
        # No full collection of this process's heap (a training controller's can be large) inside the
        # fan-out: it would hold up every reply this process reads (_gc_pause.py).
        with heap_frozen(), _operation_span(operation, payload) as current:
            ran = await self._stages_run(operation, payload, deadline_ts, stop, keep_going)
            _operation_outcome(current, ran[0], ran[1], ran[3])
            return ran

    async def _stages_run(
        self,
        operation: str,
        payload: dict[str, Any] | None,
        deadline_ts: float,
        stop: Callable[[dict[str, dict[str, Any]], list[ParticipantFailure]], bool] | None,
        keep_going: bool,
    ) -> tuple[dict[str, dict[str, Any]], list[ParticipantFailure], list[str], list[str] | None]:
        if payload is not None and self.owner is not None:
            payload = {**payload, "owner": self.owner}
        body = None if payload is None else encode_body(payload)
        budget = max(deadline_ts - time.time(), 0.0)
        stages = self._stages(operation)
        total = sum(len(stage) for stage in stages)
        counter = [0]
        replies: dict[str, dict[str, Any]] = {}
        failures: list[ParticipantFailure] = []
        for index, members in enumerate(stages):
            now = time.time()
            if keep_going and payload is not None and index and deadline_ts - now < budget / 2:
                deadline_ts = now + budget
                body = encode_body({**payload, "deadline_ts": deadline_ts})
                logger.warning(
                    "%s: earlier stages used up the deadline; %s get a fresh one", operation, [p.name for p in members]
                )
            timeout = max(deadline_ts - now, 0.0) + self.reply_grace
            stage_replies, stage_failures = await self._call_stage(operation, members, body, timeout, counter, total)
            replies.update(stage_replies)
            failures.extend(stage_failures)
            if stop is not None and stop(stage_replies, stage_failures):
                not_reached = [p.name for stage in stages[index + 1 :] for p in stage]
                return replies, failures, not_reached, sorted({p.kind for p in members})
        return replies, failures, [], None

    def _raise(self, operation: str, failures: list[ParticipantFailure], **kwargs: Any) -> None:
        if failures:
            raise CoordinationError(operation, failures, **kwargs)

    # -- operations ----------------------------------------------------------------------------

    async def status(self, *, timeout: float = 5.0) -> tuple[dict[str, dict[str, Any]], list[ParticipantFailure]]:
        """Every participant's ``status`` reply, and the failures (never raises for a participant)."""
        return await self._call_stage("status", self.participants, None, timeout, [0], len(self.participants))

    async def prepare(
        self,
        checkpoint_id: str,
        *,
        deadline_ts: float | None = None,
        timeout: float | None = None,
        take_over: bool = False,
    ) -> PrepareResult:
        """Prepare stage by stage (environment, model, agent, resources by default).

        Stops at the first stage that is not ready by the deadline or fails: later stages
        are never called. Returns the ``PrepareResult`` (``ready`` false when it stopped);
        raises ``CoordinationError`` (with the partial result as ``.result``) when a
        participant failed. Either way, participants already prepared keep admission
        closed until ``resume``: the caller must resume when it does not commit.
        """
        deadline = self._deadline(deadline_ts, timeout)

        def not_ready(stage: dict[str, dict[str, Any]], stage_failures: list[ParticipantFailure]) -> bool:
            return bool(stage_failures) or any(
                reply.get("phase") != "prepared" or not (reply.get("report") or {}).get("ready")
                for reply in stage.values()
            )

        payload: dict[str, Any] = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline}
        if take_over:
            payload["take_over"] = True  # fences the deployment's current owner for good
        replies, failures, not_reached, stopped_at = await self._run("prepare", payload, deadline, stop=not_ready)
        result = PrepareResult(checkpoint_id, stopped_at=stopped_at, not_reached=not_reached)
        for name, reply in replies.items():
            result.phases[name] = str(reply.get("phase"))
            report = reply.get("report")
            result.reports[name] = report if isinstance(report, dict) else {}
        self._raise("prepare", failures, result=result)
        return result

    async def commit(
        self,
        checkpoint_id: str,
        checkpoint_dir: str,
        episode_ids: Iterable[Any] | None,
        *,
        stop: bool = False,
        deadline_ts: float | None = None,
        timeout: float | None = None,
    ) -> CommitResult:
        """``_commit`` under a lease on ``checkpoint_dir``: retention (gc) never removes it meanwhile.

        A directory holding another checkpoint (a manifest or participants index naming another id)
        is refused before any participant is called or the lease written (``invalid_checkpoint_state``,
        ``result["other_checkpoints"]``): one participant alone would refuse, the others would write
        beside the good checkpoint and break it (``_storage/occupied.py``).
        """
        deadline = self._deadline(deadline_ts, timeout)
        try:
            others = await asyncio.to_thread(other_checkpoints, checkpoint_dir, checkpoint_id)
        except OSError:
            others = []  # not listable, so it holds nothing this check finds: each participant's write names why
        except ValueError as exc:
            others = [f"{checkpoint_dir} cannot be listed ({exc})"]
        if others:
            shown = "; ".join(others[:5]) + (f"; and {len(others) - 5} more" if len(others) > 5 else "")
            raise CoordinationError(
                "commit",
                [
                    ParticipantFailure(
                        "(checkpoint)",
                        str(checkpoint_dir),
                        "commit",
                        InvalidCheckpointState.code,
                        f"{checkpoint_dir} holds another checkpoint ({shown}); nothing was written. Commit "
                        f"{checkpoint_id} into a new directory",
                    )
                ],
                result={"other_checkpoints": others, "written": False},
            )
        async with _leased(checkpoint_dir, "commit", checkpoint_id, deadline):
            return await self._commit(checkpoint_id, checkpoint_dir, episode_ids, stop=stop, deadline_ts=deadline)

    async def _commit(
        self,
        checkpoint_id: str,
        checkpoint_dir: str,
        episode_ids: Iterable[Any] | None,
        *,
        stop: bool = False,
        deadline_ts: float | None = None,
        timeout: float | None = None,
    ) -> CommitResult:
        """Commit on every participant at once; ``episode_ids`` is the scope (None: everything held).

        When all committed, writes ``<checkpoint_dir>/gym/participants.json`` (the participants the
        checkpoint must hold); a failure to write it fails the commit (code ``invalid_checkpoint_state``).
        """
        deadline = self._deadline(deadline_ts, timeout)
        scope = None if episode_ids is None else [wire_episode_id(e) for e in episode_ids]
        payload = {
            "checkpoint_id": checkpoint_id,
            "deadline_ts": deadline,
            "checkpoint_dir": str(checkpoint_dir),
            "episode_ids": scope,
            "stop": stop,
        }
        replies, failures, _, _ = await self._run("commit", payload, deadline)
        result = CommitResult(checkpoint_id, replies)
        self._raise("commit", failures, result=result)
        # Every participant committed: record which ones the checkpoint must hold (created last).
        try:
            await asyncio.to_thread(
                write_participants_index,
                checkpoint_dir,
                checkpoint_id,
                [
                    {name: manifest.get(name) for name in ("kind", "instance", "records_sha256")}
                    for manifest in result.manifests.values()
                ],
            )
        except InvalidCheckpointState as exc:
            raise CoordinationError(
                "commit",
                [
                    ParticipantFailure(
                        "(checkpoint)", str(checkpoint_dir), "commit", exc.code, f"participants index: {exc.detail}"
                    )
                ],
                result=result,
            ) from None
        return result

    async def resume(
        self, checkpoint_id: str, *, deadline_ts: float | None = None, timeout: float | None = None
    ) -> dict[str, dict[str, Any]]:
        """Resume in the reverse of prepare's order; keeps going past failures, then reports them all.

        A stage left with too little time after a hung one gets a fresh deadline (see ``_run``).
        """
        deadline = self._deadline(deadline_ts, timeout)
        replies, failures, _, _ = await self._run(
            "resume", {"checkpoint_id": checkpoint_id, "deadline_ts": deadline}, deadline, keep_going=True
        )
        self._raise("resume", failures, result=replies)
        return replies

    async def renew(
        self, checkpoint_id: str, *, deadline_ts: float | None = None, timeout: float | None = None
    ) -> dict[str, float | None]:
        """Extend every participant's lease; returns each one's ``lease_expires_at`` (None: its reply had none)."""
        deadline = self._deadline(deadline_ts, timeout)
        replies, failures, _, _ = await self._run(
            "renew", {"checkpoint_id": checkpoint_id, "deadline_ts": deadline}, deadline
        )
        leases = {name: reply.get("lease_expires_at") for name, reply in replies.items()}
        self._raise("renew", failures, result=leases)
        return leases

    async def retire(
        self,
        checkpoint_id: str,
        episode_ids: Iterable[Any],
        *,
        deadline_ts: float | None = None,
        timeout: float | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Retire episodes: environment, then agent, then model and resources; reports every failure."""
        scope = [wire_episode_id(e) for e in episode_ids]
        if not scope:
            raise ValueError("retire needs at least one episode id")
        deadline = self._deadline(deadline_ts, timeout)
        replies, failures, _, _ = await self._run(
            "retire",
            {"checkpoint_id": checkpoint_id, "deadline_ts": deadline, "episode_ids": scope},
            deadline,
            keep_going=True,
        )
        self._raise("retire", failures, result=replies)
        return replies

    async def forget(
        self,
        checkpoint_id: str,
        rollout_ids: Iterable[str],
        *,
        deadline_ts: float | None = None,
        timeout: float | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Remove retired marks of rollouts, in retire's order; reports every failure."""
        rollouts = [str(r) for r in rollout_ids]
        if not rollouts:
            raise ValueError("forget needs at least one rollout id")
        deadline = self._deadline(deadline_ts, timeout)
        replies, failures, _, _ = await self._run(
            "forget",
            {"checkpoint_id": checkpoint_id, "deadline_ts": deadline, "rollout_ids": rollouts},
            deadline,
            keep_going=True,
        )
        self._raise("forget", failures, result=replies)
        return replies

    async def restore(
        self,
        checkpoint_id: str,
        checkpoint_dir: str,
        episode_ids: Iterable[Any],
        *,
        deadline_ts: float | None = None,
        timeout: float | None = None,
        take_over: bool = False,
    ) -> RestoreResult:
        """``_restore`` under a lease on ``checkpoint_dir``: retention (gc) never removes it meanwhile."""
        deadline = self._deadline(deadline_ts, timeout)
        async with _leased(checkpoint_dir, "restore", checkpoint_id, deadline):
            return await self._restore(
                checkpoint_id, checkpoint_dir, episode_ids, deadline_ts=deadline, take_over=take_over
            )

    async def _restore(
        self,
        checkpoint_id: str,
        checkpoint_dir: str,
        episode_ids: Iterable[Any],
        *,
        deadline_ts: float | None = None,
        timeout: float | None = None,
        take_over: bool = False,
    ) -> RestoreResult:
        """Restore on every participant at once, all or nothing.

        ``checkpoint_id`` is the restore operation's own id; ``episode_ids`` name the
        checkpointed attempts. On success every participant is in phase ``restored``
        and the caller resumes it (``resume(checkpoint_id)``) to run the replacements.
        On any failure (a refusal, a server that does not answer, participants restoring
        different checkpoints) the replacement attempts this restore created are retired
        everywhere, every participant is resumed, and the restore's ``CoordinationError`` is
        raised (clean-up failures ride along as ``cleanup_failures``, never replacing it).
        Created means installed by a participant that replied (its ``restored``), or, when
        some participant never replied (a timeout, a dropped connection), every replacement
        of the scope; a participant that refused installed nothing. A replacement some
        participant refused as ``attempt_running`` lives elsewhere (another controller runs
        it) and is left alone. Its ``result`` maps each rollout to the attempt it must start
        over as (``next_attempts``: the checkpointed attempt + 2, past the replacement), and
        names what was retired (``retired``) and left alone (``left_alone``). Before asking any participant, the
        directory is checked against its participants index: a participant it lists that is
        missing (or replaced) fails the restore at once, naming it (no participant touched;
        ``next_attempts`` are then the checkpointed attempt + 1). Without an index: a warning.
        """
        checkpointed = [wire_episode_id(e) for e in episode_ids]
        deadline = self._deadline(deadline_ts, timeout)
        # Before any participant is touched: every participant the index lists must be there.
        try:
            index = await asyncio.to_thread(check_participants_index, checkpoint_dir)
        except InvalidCheckpointState as exc:
            raise CoordinationError(
                "restore",
                [ParticipantFailure("(checkpoint)", str(checkpoint_dir), "restore", exc.code, exc.detail)],
                result={"next_attempts": {e["rollout_id"]: e["attempt"] + 1 for e in checkpointed}},
                message=f"restore {checkpoint_id}: {checkpoint_dir} does not hold every participant its index "
                "lists; no participant was asked to restore",
            ) from None
        if index is None:
            logger.warning(
                "restore %s: %s has no participants index (gym/participants.json); restoring without "
                "checking that every participant is there",
                checkpoint_id,
                checkpoint_dir,
            )
        payload: dict[str, Any] = {
            "checkpoint_id": checkpoint_id,
            "deadline_ts": deadline,
            "checkpoint_dir": str(checkpoint_dir),
            "episode_ids": checkpointed,
        }
        if take_over:
            payload["take_over"] = True
        replies, failures, _, _ = await self._run("restore", payload, deadline)
        sources = {name: reply.get("source_checkpoint_id") for name, reply in replies.items()}
        if not failures and len(set(sources.values())) > 1:
            every = ", ".join(sorted(set(map(str, sources.values()))))
            failures = [
                ParticipantFailure(
                    p.name,
                    p.url,
                    "restore",
                    INCONSISTENT_CHECKPOINT,
                    f"restored checkpoint {sources[p.name]} while the deployment restored {every}",
                )
                for p in self.participants
                if p.name in sources
            ]
        if failures:
            retired, left_alone = created_replacements(checkpointed, replies, failures)
            cleanup = await self._undo_restore(checkpoint_id, retired)
            next_attempts = {e["rollout_id"]: e["attempt"] + 2 for e in checkpointed}
            raise CoordinationError(
                "restore",
                failures,
                cleanup_failures=cleanup,
                result={
                    "next_attempts": next_attempts,
                    "retired": [capture_key(e) for e in retired],
                    "left_alone": left_alone,
                },
                message=f"restore {checkpoint_id} failed on {len(failures)} server(s); the {len(retired)} replacement "
                "attempt(s) it created were retired and every participant resumed",
            )
        source = next(iter(sources.values()), None)
        if not isinstance(source, str):
            raise CoordinationError(
                "restore",
                [
                    ParticipantFailure(
                        "(deployment)", "", "restore", BAD_REPLY, "no participant named its source_checkpoint_id"
                    )
                ],
            )
        return RestoreResult(checkpoint_id, source, replies)

    async def _undo_restore(self, checkpoint_id: str, replacements: list[dict[str, Any]]) -> list[ParticipantFailure]:
        """Retire ``replacements`` everywhere, then resume everyone; return what failed."""
        cleanup: list[ParticipantFailure] = []
        if replacements:
            try:
                await self.retire(checkpoint_id, replacements, timeout=self.cleanup_timeout)
            except CoordinationError as exc:
                cleanup.extend(exc.failures)
                logger.warning("restore %s: retiring replacements failed: %s", checkpoint_id, exc)
        try:
            await self.resume(checkpoint_id, timeout=self.cleanup_timeout)
        except CoordinationError as exc:
            cleanup.extend(exc.failures)
            logger.warning("restore %s: resuming failed: %s", checkpoint_id, exc)
        return cleanup


@contextlib.asynccontextmanager
async def _leased(checkpoint_dir: str, operation: str, checkpoint_id: str, deadline: float) -> AsyncIterator[None]:
    """A retention lease on ``checkpoint_dir`` for the operation (written and removed off the loop)."""
    lease = hold_lease(checkpoint_dir, operation, checkpoint_id, deadline)
    await asyncio.to_thread(lease.__enter__)
    try:
        yield
    finally:
        await asyncio.to_thread(lease.__exit__, None, None, None)
