"""Typed refusals of the checkpoint protocol.

Every refusal the plugin makes is one of these classes. Each carries a stable
``code`` and HTTP ``status`` from docs/protocol.md's error table; one FastAPI
exception handler (``install_error_handler``) renders them as
``{"error": {"code": ..., "detail": ...}}``. Never raise a bare exception for
bad input: pick the class whose docstring says when it is raised.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "CheckpointError",
    "CoordinatorUnreachable",
    "Unauthorized",
    "StaleCheckpoint",
    "CheckpointConflict",
    "InvalidPhase",
    "DeadlineExceeded",
    "StaleAttempt",
    "RestartInScope",
    "ExportFailed",
    "CheckpointParked",
    "RolloutIdRequired",
    "AttemptRunning",
    "TaskMismatch",
    "AmbiguousEpisode",
    "InvalidRunRequest",
    "OwnerConflict",
    "OwnerFenced",
    "InvalidCheckpointState",
    "WriteFailed",
    "ERRORS_BY_CODE",
    "error_body",
    "install_error_handler",
]


class CheckpointError(Exception):
    """Base of every protocol refusal; ``code`` and ``status`` are part of the wire contract."""

    code: ClassVar[str] = "checkpoint_error"
    status: ClassVar[int] = 409

    def __init__(self, detail: str, **data: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        # Structured facts about the refusal (an episode key, a path...), for callers and logs.
        self.data = data

    def to_body(self) -> dict[str, Any]:
        return error_body(self.code, self.detail)


class Unauthorized(CheckpointError):
    """The bearer token is missing or does not match the configured token."""

    code = "unauthorized"
    status = 401


class StaleCheckpoint(CheckpointError):
    """The checkpoint id was already resumed (the last 64 resumed ids are remembered)."""

    code = "stale_checkpoint"


class CheckpointConflict(CheckpointError):
    """Another checkpoint id is active, or a retried commit/restore names a different directory or scope."""

    code = "checkpoint_conflict"


class InvalidPhase(CheckpointError):
    """The operation is not valid in the participant's current phase."""

    code = "invalid_phase"


class DeadlineExceeded(CheckpointError):
    """The call's ``deadline_ts`` passed before (or on arrival, before) the work finished."""

    code = "deadline_exceeded"


class StaleAttempt(CheckpointError):
    """A data or control request names an attempt that was retired."""

    code = "stale_attempt"


class RestartInScope(CheckpointError):
    """A commit scope names an episode this participant reported as a restart."""

    code = "restart_in_scope"


class ExportFailed(CheckpointError):
    """This checkpoint's export failed; every later commit of the same id gets this too."""

    code = "export_failed"


class CheckpointParked(CheckpointError):
    """Admission is closed and the request cannot wait for resume."""

    code = "checkpoint_parked"


class RolloutIdRequired(CheckpointError):
    """Agent work arrived without a rollout id, so it cannot be attributed to an episode."""

    code = "rollout_id_required"
    status = 400


class _NamesEpisodes(CheckpointError):
    """A refusal whose body names the attempts it concerns: ``episodes`` (capture keys) as ``episode_ids``."""

    def to_body(self) -> dict[str, Any]:
        body = error_body(self.code, self.detail)
        episodes = self.data.get("episodes")
        if episodes:
            body["error"]["episode_ids"] = sorted(str(key) for key in episodes)
        return body


class AttemptRunning(_NamesEpisodes):
    """The episode attempt is already running on this server (plugin code, docs/protocol.md "Errors").

    Raised for a second ``/run`` of an attempt while the first runs, and for a restore whose
    replacement attempt runs here. The attempt lives elsewhere (another controller, or a request
    resent): a controller must not record it as a failure of the row. ``episodes`` (capture keys)
    ride along in the body as ``episode_ids``, so a controller knows which attempts to leave alone.
    """

    code = "attempt_running"


class TaskMismatch(_NamesEpisodes):
    """A restored episode's replacement ``/run`` carries another task than the checkpoint captured (plugin code).

    The record keeps a digest of the task its attempt ran; the replacement attempt's ``/run`` must carry
    the same task. It does not run, and the restored record stays pending for the right one. The detail
    names the episode; ``episodes`` (capture keys) ride along in the body as ``episode_ids``.
    """

    code = "task_mismatch"


class AmbiguousEpisode(CheckpointError):
    """A ``/run`` names its attempt twice: an explicit ``"<id>-aN"`` rollout id *and* a non-zero attempt.

    Plugin code (docs/protocol.md "Episodes and their ids"). An explicit suffix with attempt 0 (how
    Gym's ``_episode_request_body`` sends it) means attempt N of ``<id>``; with another attempt index
    beside it the two would disagree, so the request is refused before anything runs.
    """

    code = "ambiguous_episode_id"
    status = 422


class InvalidRunRequest(CheckpointError):
    """A ``/run`` body Gym's run logic cannot turn into an episode (plugin code).

    Raised, with checkpointing on, where Gym would answer a 500 for bad input: a flat row whose
    task identity cannot be derived (no ``task_id`` and no ``_ng_task_index``: a restored rollout
    continued by hand with only its ``_ng_rollout_id``), a bad ``task_source`` or ``agent_ref``, an
    invalid ``_ng_attempt_index``. The detail is Gym's own message and what the row needs; nothing runs.
    """

    code = "invalid_run_request"
    status = 422


class OwnerConflict(CheckpointError):
    """Another controller owns this deployment (plugin code, docs/protocol.md "One controller per deployment").

    Raised for any control call but ``status`` from a controller that is not the owner (one that
    sends no owner included) while the owner's lease runs; the detail names the owner and when its
    lease ends, and says that taking over (``take_over``) fences it for good.
    """

    code = "owner_conflict"


class OwnerFenced(CheckpointError):
    """This controller's ownership was taken over: it is fenced for good (plugin code).

    Every later call naming that owner is refused with this, whoever owns the deployment now.
    """

    code = "owner_fenced"


class CoordinatorUnreachable(CheckpointError):
    """A uvicorn worker could not reach its server's coordinator for a control call (plugin code).

    A server with several workers answers its control routes in its main process (docs/protocol.md
    section 9a); the worker that received the call found the coordinator gone or silent. Retry: the
    server is restarting or stopping.
    """

    code = "coordinator_unreachable"
    status = 503


class InvalidCheckpointState(CheckpointError):
    """A checkpoint on disk (or one being written) cannot be trusted or cannot be made.

    Raised for a manifest that is not JSON, not an object, missing fields or of
    another schema version; a records file outside the participant directory or
    missing; a digest or count mismatch; a truncated or invalid record (naming
    its episode where known); a value that is not JSON; a directory that cannot
    hold state; a directory that already holds another checkpoint's manifest.
    """

    code = "invalid_checkpoint_state"
    status = 422


class WriteFailed(InvalidCheckpointState):
    """Storing an export failed on the filesystem (full disk, read-only or unwritable directory...).

    Same code as any ``invalid_checkpoint_state``; the detail names the cause and the path. The
    export itself succeeded and is kept: a retried commit of the same checkpoint id, into the
    same or another directory, stores the same records again (docs/protocol.md "Phases").
    """


ERRORS_BY_CODE: dict[str, type[CheckpointError]] = {
    cls.code: cls
    for cls in (
        Unauthorized,
        StaleCheckpoint,
        CheckpointConflict,
        InvalidPhase,
        DeadlineExceeded,
        StaleAttempt,
        RestartInScope,
        ExportFailed,
        CheckpointParked,
        RolloutIdRequired,
        AttemptRunning,
        TaskMismatch,
        AmbiguousEpisode,
        InvalidRunRequest,
        OwnerConflict,
        OwnerFenced,
        CoordinatorUnreachable,
        InvalidCheckpointState,
    )
}


def error_body(code: str, detail: str) -> dict[str, Any]:
    return {"error": {"code": code, "detail": detail}}


def install_error_handler(app: Any) -> None:
    """Render every ``CheckpointError`` raised by a route as its JSON body and status."""
    import orjson
    from starlette.responses import Response

    async def _handle(_request: Any, exc: CheckpointError) -> Response:
        return Response(orjson.dumps(exc.to_body()), status_code=exc.status, media_type="application/json")

    app.add_exception_handler(CheckpointError, _handle)
