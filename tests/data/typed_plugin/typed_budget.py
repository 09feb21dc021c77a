"""A third-party participant plugin written against ``nemo_gym_checkpoint_plugin.api`` only, fully annotated.

tests/test_typed_api.py runs ``mypy --strict`` on this file against the built wheel: what a plugin
author type-checking their own package sees. It touches every kind of name ``api`` exports (the
marker, the values, episode ids, errors, the storage protocols).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from nemo_gym_checkpoint_plugin import api
from nemo_gym_checkpoint_plugin.api import (
    ENTRY_POINT_GROUP,
    CheckpointSettings,
    EpisodeId,
    InvalidCheckpointState,
    LeasePolicy,
    ParticipantExport,
    Phase,
    Readiness,
    RestoredRecord,
    SeedDeclaration,
    StorageBackend,
    StorageWriter,
    WriteFailed,
    from_capture_key,
    hookimpl,
    make_episode_id,
)

VERSION: str = api.__version__
GROUP: str = ENTRY_POINT_GROUP
IDLE: Phase = Phase.IDLE


class TypedBudget:
    """Keeps ``{capture key: calls left}`` for one resources server."""

    def __init__(self) -> None:
        self.budgets: dict[str, int] = {}
        self.restored: set[str] = set()
        self.grace: float | None = None

    @hookimpl
    def attach(self, server: Any, app: Any, kind: str, instance: str, settings: CheckpointSettings) -> bool:
        self.grace = settings.lease_grace_seconds
        return kind == "resources"

    @hookimpl
    def ready(self, checkpoint_id: str | None) -> Readiness:
        return Readiness(counts={"budgets": len(self.budgets)})

    @hookimpl
    def export(self, checkpoint_id: str, scope: frozenset[str] | None) -> ParticipantExport:
        keys = sorted(k for k in self.budgets if scope is None or k in scope)
        records = [{"episode_id": _wire(from_capture_key(k)), "calls_left": self.budgets[k]} for k in keys]
        return ParticipantExport(records=records)

    @hookimpl
    def install(
        self, checkpoint_id: str, manifest: Mapping[str, Any], records: list[RestoredRecord], scope: list[EpisodeId]
    ) -> None:
        for episode in scope:
            self.budgets.pop(episode.capture_key, None)
        for restored in records:
            calls_left = restored.record.get("calls_left")
            if not isinstance(calls_left, int):
                raise InvalidCheckpointState(f"episode {restored.checkpointed.capture_key}: bad calls_left")
            self.budgets[restored.replacement.capture_key] = calls_left
            self.restored.add(restored.replacement.capture_key)

    @hookimpl
    def retire(self, episode_ids: list[EpisodeId]) -> None:
        for episode in episode_ids:
            for attempt in range(episode.attempt + 1):
                key = make_episode_id(episode.rollout_id, attempt).capture_key
                self.budgets.pop(key, None)
                self.restored.discard(key)

    @hookimpl
    def restored_pending(self) -> Iterable[str]:
        return sorted(self.restored)

    @hookimpl
    def delete_restored(self, episode_ids: list[EpisodeId]) -> None:
        for episode in episode_ids:
            self.budgets.pop(episode.capture_key, None)
            self.restored.discard(episode.capture_key)

    @hookimpl
    def seed_session(self, episode_id: EpisodeId, session: Mapping[str, Any]) -> SeedDeclaration:
        return SeedDeclaration(verify_replay=True)

    @hookimpl
    def lease_policy(self, settings: CheckpointSettings) -> LeasePolicy:
        return LeasePolicy(grace_seconds=settings.lease_grace_seconds)


def _wire(episode: EpisodeId) -> dict[str, Any]:
    return {"rollout_id": episode.rollout_id, "attempt": episode.attempt}


class NullWriter:
    def write(self, records: Iterable[Mapping[str, Any]], extras: Mapping[str, Any] | None = None) -> dict[str, Any]:
        raise WriteFailed("this backend stores nothing")

    def stop(self) -> bool:
        return False


class NullRecords:
    def __init__(self) -> None:
        self.manifest: dict[str, Any] = {}
        self.records: list[dict[str, Any]] = []


class NullBackend:
    name = "null"

    def open_writer(self, checkpoint_dir: str | Path, kind: str, instance: str, checkpoint_id: str) -> StorageWriter:
        return NullWriter()

    def read(
        self,
        checkpoint_dir: str | Path,
        kind: str,
        instance: str,
        *,
        scope: Collection[str] | None = None,
        validate: Callable[[dict[str, Any]], None] | None = None,
    ) -> api.RestoredRecords:
        return NullRecords()

    def read_manifest(self, checkpoint_dir: str | Path, kind: str, instance: str) -> dict[str, Any]:
        raise InvalidCheckpointState("no manifest")


BACKEND: StorageBackend = NullBackend()
plugin = TypedBudget()
