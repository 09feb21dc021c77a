"""The policy model participant (kind ``model``): model calls in flight, held responses, retire.

docs/protocol.md, "Mid-turn boundaries": a checkpoint never waits for a generation.

- ``close_admission``: new model calls park at the admission gate (attributed by their
  ``/ng-rollout/<capture key>/...`` prefix, which the plugin's client always adds). A call
  already past the gate keeps running at the inference worker; its response is **held** if it
  has not started reaching its caller (``held_responses.py`` says what starts a response).
- ``ready`` never reports a blocker: a generation never delays a checkpoint. Its counts say
  how many calls run and how many responses are held.
- A held call belongs to no checkpoint: nothing is exported for it (the agent's boundary is
  before it). ``open_admission`` (resume) delivers every held response unchanged.
- ``retire`` cancels the running calls of the named attempts and earlier ones, concurrently and at
  most ``retire_concurrency`` at a time (the route's call to the inference worker is cancelled, so
  the worker sees its request dropped), waits for them to end, then returns; a call stopped
  before its answer started is answered ``stale_attempt``. A retried retire waits for calls an
  earlier one stopped without cancelling them again. Later calls of a retired attempt are refused by the gate.
- With Gym's token capture writing its file store (``token_capture.py``): this server owns the
  calls whose answer started reaching their caller from it, and the rows it installed; a commit
  exports only owned rows of the episodes in its scope, so neither a held call nor another model
  server's rows are ever exported. A restore installs them under the replacement attempt. A call
  of a restored attempt (>= 1) first marks the attempt started, and at its response start drops
  the restored rows it answers again (a call whose answer had not reached the agent). Such a
  server refuses to restore once it has served a call (``invalid_phase``): its capture files may
  belong to live episodes. With several workers, a worker installs the rows of a replacement when
  its first call claims them (``_control.facade.claim_install``): the restore was refused by the coordinator
  if any worker had served, so that install is not refused for the calls the worker serves since.
- With ``checkpoint_generation_cuts`` on (``cut_book.py``): the server streams each cuttable
  generation from the worker, a commit exports each in-scope episode's cut (merged into its
  capture record, field ``generation_cut``), a prepare that finds cuts generating freezes the
  workers within its share of the deadline (readiness waits for that, never for a generation),
  and the agent's re-sent call continues its restored cut.
- Each record is an ``api.Versioned`` (``model_records.py``): a checkpoint written beside this
  server's previous one refers to an episode's record while its owned calls, its capture files
  and its cut are unchanged, without reading the files.

One registry per model server process; used from its event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

from nemo_gym_checkpoint_plugin.builtin_participants.model.capture_book import CaptureBook
from nemo_gym_checkpoint_plugin.builtin_participants.model.cut_book import CUT_FIELD, CutBook
from nemo_gym_checkpoint_plugin.builtin_participants.model.cut_settings import cut_settings
from nemo_gym_checkpoint_plugin.builtin_participants.model.model_records import ModelRecords
from nemo_gym_checkpoint_plugin.builtin_participants.model.output_tokens import UsageScan
from nemo_gym_checkpoint_plugin.builtin_participants.model.token_capture import (
    StagingKeys,
    TokenCaptures,
    token_captures_for,
)
from nemo_gym_checkpoint_plugin.builtin_participants.shared.attempt_counts import AttemptCounts
from nemo_gym_checkpoint_plugin.builtin_participants.shared.attempts import RETIRE_CONCURRENCY, stop_bounded

from nemo_gym_checkpoint_plugin._control.facade import POLL_SECONDS, claim_install
from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState, InvalidPhase
from nemo_gym_checkpoint_plugin._identity import EpisodeId, capture_key
from nemo_gym_checkpoint_plugin._markers import hookimpl
from nemo_gym_checkpoint_plugin._types import ParticipantExport, Readiness, RestoredRecord

__all__ = ["ModelCall", "ModelCalls", "current_call", "install_model_calls"]

logger = logging.getLogger(__name__)

# The model call whose route runs in this context (set by the held-responses middleware).
_CURRENT_CALL: ContextVar[ModelCall | None] = ContextVar("ng_checkpoint_model_call", default=None)


def current_call() -> ModelCall | None:
    return _CURRENT_CALL.get()


class ModelCall:
    """One data request to the model server, from the gate to its last response message."""

    __slots__ = (
        "rollout_id",
        "attempt",
        "task",
        "held",
        "answered",
        "started",
        "retired",
        "finished",
        "capture_call_id",
        "body",
        "generation",
        "usage",
    )

    def __init__(self, rollout_id: str | None, attempt: int) -> None:
        self.rollout_id = rollout_id  # None: a call outside any rollout (never retired)
        self.attempt = attempt
        self.task: asyncio.Task[Any] | None = None
        self.held = False
        self.answered = False  # its reply began with a 2xx status: the worker answered it
        self.started = False  # its answer began reaching the caller
        self.retired = False
        self.finished = asyncio.Event()
        self.capture_call_id: str | None = None  # Gym's model call id, when token capture records it
        self.body: bytearray | None = None  # the request body as received (generation cuts only)
        self.generation: Any = None  # its streamed generation (``cut_stream.Generation``), generation cuts only
        self.usage: UsageScan | None = None  # its answer's output tokens (``output_tokens.py``), once answered

    @property
    def key(self) -> str | None:
        if self.rollout_id is None:
            return None
        return capture_key(self.rollout_id, self.attempt)

    def capture_id(self) -> str | None:
        """Gym's model call id of this call: noted when its reply began, else read from its task's context.

        Reads the context without entering it, so any thread may ask (the storage writer's does).
        """
        if self.capture_call_id is None and self.task is not None:
            context = self.task.get_context().get(_capture_context_var())
            if context is not None:
                self.capture_call_id = context.model_call_id
        return self.capture_call_id


def _capture_context_var() -> Any:
    # Gym keeps the capture context of a model call in this ContextVar (nemo-gym 0.7's token_id_capture.sink).
    from nemo_gym.token_id_capture import sink

    return sink._CAPTURE_CONTEXT


class ModelCalls:
    """Participant plugin of a Gym model server (see the module docstring)."""

    # How many retired calls a retire stops at once (``shared.attempts.stop_bounded``).
    retire_concurrency = RETIRE_CONCURRENCY

    def __init__(self, server: Any = None, captures: TokenCaptures | None = None) -> None:
        self.server: Any = None
        self.captures = captures
        self.book = CaptureBook(captures) if captures is not None else None
        self.records = ModelRecords(captures)
        self.cuts: CutBook | None = None
        if server is not None:
            self._bind(server, captures)
        self._open = asyncio.Event()
        self._open.set()
        self._by_rollout: dict[str | None, set[ModelCall]] = {}
        self.in_flight = 0
        self.held = 0
        self.served_total = 0
        self.held_total = 0
        self.stopped_total = 0
        # Model calls answered (2xx) per rollout and attempt, for the controller's lost-work ledger (the commit
        # reply's ``answered_calls``); dropped when the rollout is forgotten or retired: it holds rollouts in flight.
        self._answered = AttemptCounts()
        # The output tokens those calls' answers reported (``answered_output_tokens``; output_tokens.py), kept alike.
        self._answered_tokens = AttemptCounts()

    def _bind(self, server: Any, captures: TokenCaptures | None = None) -> None:
        self.server = server
        if captures is None:
            self.captures = captures = token_captures_for(server)
            self.book = CaptureBook(captures) if captures is not None else None
            self.records = ModelRecords(captures)
        if getattr(server, "server_client", None) is not None:
            settings = cut_settings(server.server_client.global_config_dict, str(server.config.name))
            if settings.enabled:
                self.cuts = CutBook(settings, server, current_call)

    @hookimpl
    def attach(self, server: Any, kind: str) -> bool:
        """Every model server is one: its calls in flight (and its token capture, its generation cuts)."""
        if kind != "model":
            return False
        self._bind(server)
        return True

    @hookimpl
    def serving(self, app: Any) -> None:
        install_model_calls(app, self)

    # -- the middleware's side ---------------------------------------------------------------------

    def begin(self, attempt: tuple[str, int] | None) -> ModelCall:
        rollout_id, number = attempt if attempt is not None else (None, 0)
        call = ModelCall(rollout_id, number)
        self._by_rollout.setdefault(rollout_id, set()).add(call)
        self.in_flight += 1
        return call

    async def arrived(self, call: ModelCall) -> None:
        """Before the call's route runs: a restored attempt's call marks it started (token capture)."""
        key = call.key
        if self.book is not None and key is not None:
            await self.book.begin(key)

    def end(self, call: ModelCall) -> None:
        siblings = self._by_rollout.get(call.rollout_id)
        if siblings is not None:
            siblings.discard(call)
            if not siblings:
                del self._by_rollout[call.rollout_id]
        self.in_flight -= 1
        self.served_total += 1
        call.finished.set()

    def answered(self, call: ModelCall) -> None:
        """The call's reply begins with a 2xx status: the worker answered it (held or not)."""
        call.answered = True
        if call.rollout_id is not None:
            self._answered.add(call.rollout_id, call.attempt)
            call.usage = UsageScan()

    def answer_data(self, call: ModelCall, chunk: bytes) -> None:
        """A body chunk of an answered call, before it goes out (or is held): counts the tokens it reports."""
        usage = call.usage
        if usage is None or call.rollout_id is None:
            return
        before = usage.tokens or 0
        if usage.feed(chunk):
            self._answered_tokens.add(call.rollout_id, call.attempt, (usage.tokens or 0) - before)

    async def starting(self, call: ModelCall) -> None:
        """The call's reply begins (its status line is about to be sent): its row is written by now.

        Notes its capture id while it is set and, for a restored attempt, drops the restored rows
        this call answers again, before the answer can reach the agent.
        """
        key = call.key
        if self.book is not None and key is not None:
            await self.book.answering(key, call.capture_id())

    def delivered(self, call: ModelCall) -> None:
        """The call's first answer data goes out: from now on its row is this server's to export."""
        call.started = True
        key = call.key
        if self.book is not None and key is not None:
            self.book.delivered(key, call.capture_id())

    async def hold(self, call: ModelCall) -> None:
        """Return once admission is open (at once when it is): the call's response may start."""
        if self._open.is_set():
            return
        call.held = True
        self.held += 1
        self.held_total += 1
        try:
            # A wake that finds a new checkpoint already closed admission holds on for that one too.
            while not self._open.is_set():
                await self._open.wait()
        finally:
            call.held = False
            self.held -= 1

    # -- participant hooks -------------------------------------------------------------------------

    @hookimpl
    def close_admission(self, checkpoint_id: str) -> None:
        self._open.clear()

    @hookimpl
    def preparing(self, checkpoint_id: str, deadline_ts: float) -> None:
        cuts = self.cuts
        if cuts is not None and cuts.freeze is not None and cuts.cuttable(self._calls()):
            cuts.freeze.start(deadline_ts)

    @hookimpl
    def open_admission(self, checkpoint_id: str) -> None:
        self._open.set()
        if self.book is not None:
            self.book.ended(checkpoint_id)
        if self.cuts is not None and self.cuts.freeze is not None:
            self.cuts.freeze.thaw()

    @hookimpl
    def ready(self, checkpoint_id: str | None) -> Readiness:
        # A generation in flight runs on, and its response is held if not started: it never blocks. Only
        # freezing the workers does, within its share of the prepare's deadline (cut_freeze.py).
        counts = {"model_calls_in_flight": self.in_flight, "model_responses_held": self.held}
        cuts = self.cuts
        if cuts is not None and cuts.freeze is not None and cuts.freeze.freezing:
            return Readiness(blockers=cuts.cuttable(self._calls()), counts=counts)
        return Readiness(counts=counts)

    @hookimpl
    async def wait_ready(self, checkpoint_id: str) -> None:
        cuts = self.cuts
        task = cuts.freeze.task if cuts is not None and cuts.freeze is not None else None
        if task is not None and not task.done():
            await asyncio.shield(task)
            return
        # Nothing of ours to wait for; another plugin's blockers may lack a wait_ready: re-ask soon, as the
        # control plane does when no plugin implements it.
        await asyncio.sleep(POLL_SECONDS)  # wait-ok: the control plane's own poll interval

    @hookimpl
    async def retire(self, episode_ids: list[EpisodeId]) -> None:
        victims: list[ModelCall] = []
        for episode in episode_ids:
            for call in self._by_rollout.get(episode.rollout_id, ()):
                if call.attempt <= episode.attempt:
                    victims.append(call)

        def stop(call: ModelCall) -> bool:
            if call.retired:  # a retried retire waits for what an earlier one stopped (below), never again
                return False
            call.retired = True
            self.stopped_total += 1
            if call.task is not None:
                call.task.cancel()
            return True

        async def ended(call: ModelCall) -> None:
            await call.finished.wait()

        # Concurrently, a bounded number at a time: each cancelled call runs its end (its refusal reply).
        await stop_bounded(victims, stop, ended, self.retire_concurrency)
        for call in victims:
            # Those an earlier retire stopped too; a finished call's wait returns at once.
            await call.finished.wait()
        self._answered.retire(episode_ids)
        self._answered_tokens.retire(episode_ids)
        if self.cuts is not None:
            self.cuts.retired(episode_ids)
        if self.book is not None:
            freed = self.book.retired(episode_ids)
            if freed:
                await self.delete_restored(freed)

    @hookimpl
    def forgotten(self, rollout_ids: list[str]) -> None:
        self._answered.forget(rollout_ids)
        self._answered_tokens.forget(rollout_ids)

    def ledger_extras(self) -> dict[str, Any]:
        """The commit reply's ``answered_calls``, ``held_calls``, ``running_calls``, ``answered_output_tokens``
        and ``held_output_tokens`` (per capture key; docs/protocol.md, "Routes", the model participant's commit
        reply). The tokens name only the episodes whose answers reported usage (``output_tokens.py``)."""
        held: dict[str, int] = {}
        held_tokens: dict[str, int] = {}
        running: dict[str, int] = {}
        for call in self._calls():
            key = call.key
            if key is None:
                continue
            if call.held:
                held[key] = held.get(key, 0) + 1
                if call.usage is not None and call.usage.tokens is not None:
                    held_tokens[key] = held_tokens.get(key, 0) + call.usage.tokens
            elif not call.answered:
                running[key] = running.get(key, 0) + 1
        return {
            "answered_calls": self._answered.by_key(),
            "held_calls": held,
            "running_calls": running,
            "answered_output_tokens": self._answered_tokens.by_key(),
            "held_output_tokens": held_tokens,
        }

    def _calls(self) -> Iterator[ModelCall]:
        for calls in self._by_rollout.values():
            yield from calls

    # -- token capture (capture_book.py, token_capture.py) -----------------------------------------

    @hookimpl
    def export(self, checkpoint_id: str, scope: frozenset[str] | None) -> ParticipantExport | None:
        """One ``Versioned`` record per in-scope episode with owned rows or a cut (``model_records.py``)."""
        cuts = self.cuts.snapshot(self._calls(), scope) if self.cuts is not None else {}
        # Versions taken now, with the snapshots: a generation goes on streaming while the records are written.
        versioned_cuts = {key: (source, CutBook.version(source)) for key, source in cuts.items()}
        owned: dict[str, tuple[int, set[str]]] = {}
        if self.book is not None:
            # Calls held or still generating are owned by no one: their rows are never exported. None can
            # start while the checkpoint is open, so ownership cannot change during the export.
            running = {call.key for call in self._calls() if call.key is not None}
            owned = self.book.owned_in(scope, running)
        staging = StagingKeys() if self.captures is not None and self.captures.ledger else None
        # Staging keys: filled as the records are written; the commit replies once the write is done.
        extras = (
            {} if staging is None else {"staging_keys": staging.keys, "staging_keys_by_episode": staging.by_episode}
        )
        # Versioned (ParticipantExport names plain records; the writer takes both).
        records: Iterable[Any] = self.records.export(owned, versioned_cuts, staging)
        return ParticipantExport(records=records, reply_extras={**extras, **self.ledger_extras()})

    @hookimpl
    async def install(
        self, checkpoint_id: str, manifest: Mapping[str, Any], records: list[RestoredRecord], scope: list[EpisodeId]
    ) -> None:
        cut_records = {
            r.replacement.capture_key: (r.checkpointed.capture_key, r.record[CUT_FIELD])
            for r in records
            if CUT_FIELD in r.record
        }
        # This release's rows (``token_rows``, ``ledger_rows``) and an earlier release's (``*_entries``).
        captured = [r for r in records if not _CAPTURE_FIELDS.isdisjoint(r.record)]
        cuts = self.cuts.checked(cut_records) if self.cuts is not None else {}  # a refused cut installs nothing
        # A worker's claim of one replacement (several workers) comes after the restore, while other episodes run:
        # its coordinator refused the restore itself if any worker had served a call.
        claimed = claim_install()
        if self.book is None:
            if captured:
                raise InvalidCheckpointState("the checkpoint holds token captures; token_id_capture is off here")
        else:
            if not claimed and (self.served_total or self.in_flight):
                raise InvalidPhase(
                    f"this model server has served {self.served_total + self.in_flight} model calls: its token "
                    "capture files may belong to live episodes, so it cannot restore (restore into fresh processes)"
                )
            await self.book.install(checkpoint_id, captured, scope, claimed=claimed)
        if self.cuts is None:
            if cut_records:
                # A cut only saves generating again: without cuts on here, those calls are generated from scratch.
                logger.warning(
                    "%d generation cuts in the checkpoint are ignored: checkpoint_generation_cuts is off here",
                    len(cut_records),
                )
            return
        self.cuts.keep(cuts)
        if self.cuts.freeze is not None:
            await self.cuts.freeze.resume_all()  # a crashed model server may have left a worker frozen

    @hookimpl
    def restored_pending(self) -> list[str]:
        pending = set(self.book.pending()) if self.book is not None else set()
        if self.cuts is not None:
            pending.update(self.cuts.pending())
        return sorted(pending)

    @hookimpl
    async def delete_restored(self, episode_ids: list[EpisodeId]) -> None:
        if self.cuts is not None:
            self.cuts.drop(episode.capture_key for episode in episode_ids)
        # Only attempts this server installed: a refused install must not touch a live attempt's files.
        if self.book is not None:
            await self.book.delete(episode.capture_key for episode in episode_ids)

    @hookimpl
    def status_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "model_calls": {
                "in_flight": self.in_flight,
                "held": self.held,
                "served_total": self.served_total,
                "held_total": self.held_total,
                "stopped_total": self.stopped_total,
            },
            "generation_cuts": {"enabled": False} if self.cuts is None else self.cuts.status(self._calls()),
        }
        return fields


_CAPTURE_FIELDS = frozenset({"token_rows", "ledger_rows", "token_entries", "ledger_entries"})


def install_model_calls(app: Any, calls: ModelCalls) -> None:
    """Install the held-responses middleware of ``calls`` on a model server's ``app``."""
    from nemo_gym_checkpoint_plugin.builtin_participants.model.held_responses import install_held_responses

    install_held_responses(app, calls)
