"""The public API of nemo-gym-checkpoint for plugin authors: import from here, nothing deeper.

Everything a participant plugin, a third-party verifier or a storage backend needs:

- ``hookimpl`` marks your hook implementations; ``ENTRY_POINT_GROUP`` is the entry-point group
  your package publishes its plugin under (``[project.entry-points.nemo_gym_checkpoint]``).
- The values exchanged with the control plane: ``Readiness`` (answer of ``ready``),
  ``ParticipantExport`` (answer of ``export``), ``RestoredRecord`` (what ``install`` receives),
  ``SeedDeclaration`` (answer of ``seed_session``), ``LeasePolicy``, ``Phase``, ``PrepareReport``,
  ``CheckpointSettings`` (the validated ``checkpoint:`` block ``attach`` receives).
- Episode ids: ``EpisodeId`` (``rollout_id``, ``attempt``, ``capture_key``), ``capture_key(rollout_id,
  attempt)`` (the key without building an ``EpisodeId``), ``from_capture_key`` (the way back),
  ``episode_to_wire`` / ``episode_from_wire`` (the ``{"rollout_id", "attempt"}`` of records and bodies),
  ``make_episode_id``, ``AmbiguousEpisodeId``.
- The typed refusals of the protocol (``CheckpointError`` and one class per code); raise the one
  whose docstring fits, never a bare exception for bad input.
- ``StorageBackend``, ``StorageWriter`` and ``RestoredRecords``: the protocols a backend answering
  the ``storage_backend`` hook implements.
- ``__version__``: the installed distribution's version (``nemo-gym-checkpoint``), for a plugin
  that needs to say which release it was checked against.

The package ships ``py.typed``: a plugin written against this module type-checks with
``mypy --strict`` (tests/test_typed_api.py checks one).

The hooks themselves and their contracts: ``nemo_gym_checkpoint_plugin.hookspecs`` and
docs/plugins.md. Names not exported here are private and may change without notice.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ._errors import (
    AttemptRunning,
    CheckpointConflict,
    CheckpointError,
    CheckpointParked,
    DeadlineExceeded,
    ExportFailed,
    InvalidCheckpointState,
    InvalidPhase,
    RestartInScope,
    RolloutIdRequired,
    StaleAttempt,
    StaleCheckpoint,
    Unauthorized,
    WriteFailed,
)
from ._identity import (
    AmbiguousEpisodeId,
    EpisodeId,
    capture_key,
    episode_from_wire,
    episode_to_wire,
    from_capture_key,
    make_episode_id,
)
from ._markers import PROJECT as ENTRY_POINT_GROUP
from ._markers import hookimpl
from ._settings import CheckpointSettings
from ._types import (
    LeasePolicy,
    ParticipantExport,
    Phase,
    PrepareReport,
    Readiness,
    RestoredRecord,
    SeedDeclaration,
    Versioned,
)

try:
    # From the installed metadata, so it is pyproject's version and never a second copy of it.
    __version__: str = version("nemo-gym-checkpoint")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    "ENTRY_POINT_GROUP",
    "hookimpl",
    # values
    "CheckpointSettings",
    "LeasePolicy",
    "ParticipantExport",
    "Phase",
    "PrepareReport",
    "Readiness",
    "RestoredRecord",
    "SeedDeclaration",
    "Versioned",
    # episode ids
    "AmbiguousEpisodeId",
    "EpisodeId",
    "capture_key",
    "episode_from_wire",
    "episode_to_wire",
    "from_capture_key",
    "make_episode_id",
    # errors
    "CheckpointConflict",
    "CheckpointError",
    "CheckpointParked",
    "AttemptRunning",
    "DeadlineExceeded",
    "ExportFailed",
    "InvalidCheckpointState",
    "InvalidPhase",
    "RestartInScope",
    "RolloutIdRequired",
    "StaleAttempt",
    "StaleCheckpoint",
    "Unauthorized",
    "WriteFailed",
    # storage
    "RestoredRecords",
    "StorageBackend",
    "StorageWriter",
]


@runtime_checkable
class StorageWriter(Protocol):
    """Writes one participant's checkpoint; used once, from a worker thread.

    ``write`` consumes ``records`` (JSON objects with an ``episode_id``) one at a time and
    publishes the manifest last, returning it (``extras`` are added under their own keys).
    Raise ``WriteFailed`` for a filesystem failure (the export is kept and retried) and
    ``InvalidCheckpointState`` for a record that cannot be stored. ``stop`` (a resume, from the
    event loop thread) makes the write quit; once it returned no manifest may appear. It
    returns whether the manifest had already been published.
    """

    def write(
        self, records: Iterable[Mapping[str, Any]], extras: Mapping[str, Any] | None = None
    ) -> dict[str, Any]: ...

    def stop(self) -> bool: ...


@runtime_checkable
class RestoredRecords(Protocol):
    """What ``StorageBackend.read`` returns: the verified ``manifest`` and the ``records`` in scope."""

    manifest: dict[str, Any]
    records: list[dict[str, Any]]


@runtime_checkable
class StorageBackend(Protocol):
    """A storage backend, as the ``storage_backend`` hook returns it (docs/protocol.md, "On-disk format").

    ``name`` is what ``checkpoint.storage.backend`` selects. ``checkpoint_dir`` is what the controller
    sent: an absolute path, or an fsspec URL (``s3://...``) that a backend writing object stores takes
    (the built-in ``fsspec``; ``local`` refuses one with ``WriteFailed``). ``read`` verifies the participant's
    manifest, digest and count before returning anything, keeps only records whose capture key is
    in ``scope`` (``None``: all) and calls ``validate`` on each kept record (a ``ValueError`` is
    reported as ``invalid_checkpoint_state`` naming the episode); every refusal is an
    ``InvalidCheckpointState``. Methods are called from worker threads.
    """

    name: str

    def open_writer(
        self, checkpoint_dir: str | Path, kind: str, instance: str, checkpoint_id: str
    ) -> StorageWriter: ...

    def read(
        self,
        checkpoint_dir: str | Path,
        kind: str,
        instance: str,
        *,
        scope: Collection[str] | None = None,
        validate: Callable[[dict[str, Any]], None] | None = None,
    ) -> RestoredRecords: ...

    def read_manifest(self, checkpoint_dir: str | Path, kind: str, instance: str) -> dict[str, Any]: ...
