"""Participant hooks: what one Gym server contributes to a checkpoint.

A server process has one control plane; every plugin registered on its manager
that implements these hooks is part of that participant (the built-in
participant of its kind, plus e.g. a third-party verifier). All hooks here are
*collected* (every implementation is called, answers merged) and called with
keyword arguments through the typed facade ``_control.facade.Participants``.

Any hook may be ``async def``: the control plane awaits what it returns. Hooks
are called from the server's event loop thread. Raising a ``CheckpointError``
sends its code to the controller; any other exception is described below per hook.

Phases are those of docs/protocol.md: ``idle``, ``preparing``, ``prepared``, ``committed``,
``restored``.

Records are owned: the participant's own plugins (its built-in participant, and plugins an
embedding hands to ``make_plugin_manager``) write records as they are; the records of a
third-party plugin (loaded from the ``nemo_gym_checkpoint`` entry-point group) are tagged
``"plugin": <its entry-point name>`` by the control plane, and a restore hands each plugin only
its own records (see ``export`` and ``install``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nemo_gym_checkpoint_plugin._markers import hookspec

if TYPE_CHECKING:
    from nemo_gym_checkpoint_plugin._admission import RetiredMarks
    from nemo_gym_checkpoint_plugin._identity import EpisodeId
    from nemo_gym_checkpoint_plugin._settings import CheckpointSettings
    from nemo_gym_checkpoint_plugin._types import (
        ParticipantExport,
        Readiness,
        RestoredRecord,
        SeedDeclaration,
    )


@hookspec
def attach(server: Any, app: Any, kind: str, instance: str, settings: CheckpointSettings) -> bool | None:
    """This plugin's server just became a participant: learn what you serve, or opt out.

    Called once per server process, when checkpointing is enabled, after the server built its
    FastAPI ``app`` (``setup_webserver``) and before the control routes and the admission gate
    are installed or anything is served. ``server`` is the Gym server object (reach its state
    from here), ``kind`` one of ``environment``, ``model``, ``agent``, ``resources``,
    ``instance`` the server's name in the Gym config, ``settings`` the validated
    ``checkpoint:`` block. Must not wait (a synchronous hook: an awaitable answer is an error).
    Return ``False`` when this plugin does not apply to this server: it is unregistered and
    takes no further part in this process; ``None`` or ``True`` keeps it. Raising stops the
    server from starting, naming the plugin.
    """


@hookspec
def serving(app: Any, marks: RetiredMarks) -> None:
    """The participant is about to serve: add what this plugin needs on the request path.

    Called once per server process, on the plugins ``attach`` kept, after the control plane
    was built and before the admission gate is added or anything is served. Add your ASGI
    middleware to ``app`` here, never in ``attach`` (a server that then fails to start keeps
    its app untouched); middleware added here runs inside the gate. ``marks`` are the
    participant's retired marks, kept current by every retire and forget:
    ``marks.is_retired(rollout_id, attempt)`` and ``marks.retired_up_to(rollout_id)`` (None:
    no mark). The gate refuses a retired attempt's request; check the marks where an episode
    begins too, so a request already past the gate stays refused (raise ``StaleAttempt``).
    Must not wait (a synchronous hook). Raising stops the server from starting.
    """


@hookspec
def close_admission(checkpoint_id: str) -> None:
    """Admission just closed for ``checkpoint_id`` (a prepare or a restore starting).

    Called under the transition lock, after the shared ``Admission`` closed, so new data
    requests already park at the gate. Close what the gate cannot see (e.g. a model's
    own queue). Raising aborts the prepare or restore: admission reopens
    (``open_admission`` is called) and the error is the reply.
    """


@hookspec
def preparing(checkpoint_id: str, deadline_ts: float) -> None:
    """A prepare of ``checkpoint_id`` just closed admission; ``deadline_ts`` is its deadline.

    Called once per checkpoint, under the transition lock, right after ``close_admission``
    and before readiness is first asked (never for a restore). Must not wait: start here the
    bounded work this participant's readiness then waits for (report blockers until it is
    done, return from ``wait_ready`` when it is), and leave the later stages of the
    coordination order their share of the deadline. Raising aborts the prepare like
    ``close_admission`` does.
    """


@hookspec
def open_admission(checkpoint_id: str) -> None:
    """Admission reopened after ``checkpoint_id`` (resume, lease expiry, or an aborted prepare/restore).

    Called once the shared ``Admission`` is open again; undo ``close_admission``. Raising
    is logged and does not keep admission closed (phase and admission never disagree).
    """


@hookspec
def ready(checkpoint_id: str | None) -> Readiness | None:
    """Report readiness now: ``Readiness(blockers, restarts, counts)``, capture keys; or ``None``.

    Called while preparing (after admission closed, and again each time ``wait_ready``
    returns), at commit (readiness that regressed since prepare fails the commit with
    ``invalid_phase``) and by ``status`` in any phase (``checkpoint_id`` then ``None``
    when idle). Must be cheap and must not wait. A blocker is an episode whose state
    cannot be exported yet (a step in ``wait`` mode, an episode being retired); a restart
    is an episode this participant can never capture: listed, never blocking. Raising
    fails the prepare (admission reopens) or the status call.
    """


@hookspec
def wait_ready(checkpoint_id: str) -> None:
    """Return (or finish awaiting) when this participant's blockers may have changed since this call.

    Since this call, not since the awaitable first runs: the control plane awaits it as a task, which
    starts on a later turn of the event loop, and a blocker that clears in between must still wake it
    (take what a change is measured against in the call itself, not inside a coroutine's body).
    Called while ``preparing`` after a ``ready`` answer with blockers; the control plane
    re-asks ``ready`` when any implementation returns and cancels the others, and cancels
    all at the prepare's deadline or on resume. Without any implementation the control
    plane polls ``ready`` briefly. Raising fails the prepare (admission reopens).
    """


@hookspec
def export(checkpoint_id: str, scope: frozenset[str] | None) -> ParticipantExport | Iterable[Mapping[str, Any]] | None:
    """Return what this plugin holds inside ``scope`` (capture keys; ``None``: everything).

    Called once per checkpoint, in phase ``prepared`` by the first ``commit`` (a checkpoint
    never exports twice), after the scope was checked against the reported restarts. Return
    a ``ParticipantExport`` or an iterable of records (JSON objects with ``episode_id``);
    ``None`` means nothing. A third-party plugin's records are tagged with its name (field
    ``"plugin"``) as they are written; the participant's own records must not set that field.
    Records are consumed by the storage writer in a worker thread, so a lazy iterator must be
    thread-safe to advance there. Never export a restart. A resume cancels a running export.
    Raising ends the checkpoint for good: this commit replies ``export_failed`` (a
    ``CheckpointError`` keeps its own code) and every later commit of the id replies
    ``export_failed``.
    """


@hookspec
def release_exported(checkpoint_id: str, episode_keys: list[str]) -> None:
    """The commit had ``stop: true`` and its write is durable: free what exported state holds outside the process.

    Called after the manifest was published (phase ``committed``) with the capture keys
    written. Free sandboxes, remote sessions. Raising is logged, never fails the commit.
    """


@hookspec
def restored_pending() -> Iterable[str] | None:
    """Capture keys of restored episodes this plugin holds that have not started yet.

    Called by a commit after its write: those the commit scope leaves out are deleted
    with ``delete_restored``. Must not wait. Raising is logged and nothing is deleted.
    """


@hookspec
def delete_restored(episode_ids: list[EpisodeId]) -> None:
    """Delete restored, not yet started episodes the controller no longer continues.

    Called after a commit's write, for restored-pending episodes its scope leaves out; a
    resume waits (within its deadline) for it to finish. Must leave nothing that would
    refuse the attempt later (no retired mark, no half state). Raising is logged.
    """


@hookspec
def install(
    checkpoint_id: str, manifest: Mapping[str, Any], records: list[RestoredRecord], scope: Sequence[EpisodeId]
) -> None:
    """Install restored records as their replacement attempts (``checkpointed.attempt + 1``).

    Called by ``restore`` in phase ``restored``, after the scope was marked retired up to
    the checkpointed attempts, the records were read and verified, and ``retire`` was
    called for the checkpointed attempts read (a process that did not crash frees them).
    Each plugin gets only its own records in the restore's scope (a third-party plugin those
    tagged with its name; the participant's own plugins the untagged ones), possibly none, and
    ``scope``: the replacement attempt of every episode the restore continues, including those
    it holds no record of (clear per-episode state kept outside the records there). A record
    naming a plugin this server lacks fails the restore (``invalid_checkpoint_state``) before
    any install. ``checkpoint_id`` is the restore operation's id. An install
    that outlives the restore's deadline keeps running and is kept; a retire or the next
    restore waits for it and admission reopens only once it finished. Raise
    ``InvalidCheckpointState`` (or ``ValueError``, reported as such) for a record this
    participant refuses; a raising install must leave nothing installed (the control
    plane also calls ``delete_restored`` for the replacement attempts).

    On a server with several uvicorn workers (docs/protocol.md, "Several workers") a restore
    installs nothing in the workers: a worker's install is called when its first request of a
    replacement claims the records, with that one episode as ``scope``, after the restore
    resumed, while the worker may be serving other episodes (the built-in model participant
    tells the two apart with ``_control.facade.claim_install``).
    """


@hookspec
def retire(episode_ids: list[EpisodeId]) -> None:
    """Stop the running work of these attempts (and earlier ones of the same rollout), wait for it, free its state.

    Called in phase ``idle`` or ``restored``, after every attempt named was marked retired
    (requests for them already get ``stale_attempt``) and after a running install finished.
    Bound by the retire's deadline: past it the call keeps running and the retire replies
    ``deadline_exceeded`` (the marks stay). Raising fails the retire; the marks stay.
    """


@hookspec
def forgotten(rollout_ids: list[str]) -> None:
    """The controller forgot these rollouts (their ``/run`` returned): drop what is kept about them for reports.

    Called by ``forget`` after their retired marks were removed, in phase ``idle`` or
    ``restored``. Must not wait. Raising fails the forget (the marks are already gone).
    """


@hookspec
def seed_session(episode_id: EpisodeId, session: Mapping[str, Any]) -> SeedDeclaration | None:
    """A resources server seeded the session of ``episode_id``; declare how it checkpoints.

    Called by the Gym attachment after the server's ``/seed_session`` handler succeeded,
    with its request body; not phase-bound. Return ``SeedDeclaration(restart=...,
    verify_replay=...)`` or ``None``: ``restart`` from any plugin makes the episode a
    restart (reply header ``x-ng-checkpoint-restart``); ``verify_replay`` is sent as
    ``x-ng-checkpoint-verify: replay`` only when every declaring plugin allows it
    (``None`` declares nothing; the built-in resources participant answers ``None`` for a
    capturable episode of a server not declared ``stateless``, and never replay for a
    restart). Declare replay only if running ``/verify`` twice on a request gives the same
    verdict and changes nothing. Raising fails the seed request.
    """


@hookspec
def status_fields() -> Mapping[str, Any] | None:
    """Participant-specific fields added to the ``status`` reply.

    Called by every ``status`` call, in any phase. Keys must not replace the protocol's
    status fields (those win). Must be cheap. Raising fails the status call.
    """
