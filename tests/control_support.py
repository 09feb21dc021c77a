"""Shared pieces of the control-plane tests: an in-test participant plugin, an app, a client.

``Participant`` is a plain class with ``@hookimpl`` methods holding episodes in a dict;
tests steer it (blockers, gates that hold a hook, errors to raise) and read what it was
asked to do. ``HookRecorder`` records every hook call through pluggy's monitoring.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pluggy
from fastapi import FastAPI

from nemo_gym_checkpoint_plugin._control import ControlPlane, LeasePolicy, ParticipantExport, Readiness, SeedDeclaration
from nemo_gym_checkpoint_plugin._errors import WriteFailed
from nemo_gym_checkpoint_plugin._identity import EpisodeId, from_capture_key
from nemo_gym_checkpoint_plugin._markers import hookimpl
from nemo_gym_checkpoint_plugin._plugins import make_plugin_manager
from nemo_gym_checkpoint_plugin._routes import CONTROL_PREFIX, BodyLimits, attach
from nemo_gym_checkpoint_plugin._storage import LocalStorage

TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KIND = "environment"
INSTANCE = "env_one"


def deadline(seconds: float = 10.0) -> float:
    return time.time() + seconds


def wire(key: str) -> dict[str, Any]:
    episode = from_capture_key(key)
    return {"rollout_id": episode.rollout_id, "attempt": episode.attempt}


async def wait_until(condition: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Poll ``condition`` with a deadline (never a fixed sleep standing in for it)."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.005)  # wait-ok: polling interval of a bounded condition wait


class Gate:
    """Holds a hook until released; ``entered`` says the hook is being held right now."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self._release = asyncio.Event()

    def release(self) -> None:
        self._release.set()

    async def hold(self) -> None:
        self.entered.set()
        await self._release.wait()


@dataclass
class Participant:
    """An in-test participant: episodes are ``capture key -> state`` in a dict."""

    episodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    blockers: set[str] = field(default_factory=set)
    restarts: set[str] = field(default_factory=set)
    pending: set[str] = field(default_factory=set)
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    export_gate: Gate | None = None
    install_gate: Gate | None = None
    retire_gate: Gate | None = None
    delete_gate: Gate | None = None
    export_error: BaseException | None = None
    install_error: BaseException | None = None
    close_error: BaseException | None = None
    open_error: BaseException | None = None
    ready_error: BaseException | None = None
    release_error: BaseException | None = None
    delete_error: BaseException | None = None
    records_outside_scope: bool = False
    # Wraps the exported records (e.g. a generator that holds the writer thread mid-file).
    records_wrapper: Callable[[list[dict[str, Any]]], Iterable[dict[str, Any]]] | None = None
    seed: SeedDeclaration | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, *keys: str, step: int = 1) -> None:
        for key in keys:
            self.episodes[key] = {"episode_id": wire(key), "step": step}

    def unblock(self, key: str) -> None:
        self.blockers.discard(key)
        self.changed.set()

    def called(self, name: str) -> list[dict[str, Any]]:
        return [kwargs for hook, kwargs in self.calls if hook == name]

    @hookimpl
    def close_admission(self, checkpoint_id: str) -> None:
        self.calls.append(("close_admission", {"checkpoint_id": checkpoint_id}))
        if self.close_error is not None:
            raise self.close_error

    @hookimpl
    async def open_admission(self, checkpoint_id: str) -> None:
        self.calls.append(("open_admission", {"checkpoint_id": checkpoint_id}))
        if self.open_error is not None:
            raise self.open_error

    @hookimpl
    def ready(self, checkpoint_id: str | None) -> Readiness:
        if self.ready_error is not None:
            raise self.ready_error
        return Readiness(
            blockers=set(self.blockers), restarts=set(self.restarts), counts={"episodes": len(self.episodes)}
        )

    @hookimpl
    async def wait_ready(self, checkpoint_id: str) -> None:
        await self.changed.wait()
        self.changed.clear()

    @hookimpl
    async def export(self, checkpoint_id: str, scope: frozenset[str] | None) -> ParticipantExport:
        self.calls.append(("export", {"checkpoint_id": checkpoint_id, "scope": scope}))
        if self.export_gate is not None:
            await self.export_gate.hold()
        if self.export_error is not None:
            raise self.export_error
        keys = [k for k in sorted(self.episodes) if k not in self.restarts]
        if scope is not None and not self.records_outside_scope:
            keys = [k for k in keys if k in scope]
        records = [dict(self.episodes[k]) for k in keys]
        return ParticipantExport(
            records=records if self.records_wrapper is None else self.records_wrapper(records),
            manifest_extras={"participant_note": "in-test"},
            reply_extras={"exported_count": len(keys), "phase": "not-a-protocol-override"},
        )

    @hookimpl
    def release_exported(self, checkpoint_id: str, episode_keys: list[str]) -> None:
        self.calls.append(("release_exported", {"checkpoint_id": checkpoint_id, "episode_keys": episode_keys}))
        if self.release_error is not None:
            raise self.release_error

    @hookimpl
    def restored_pending(self) -> set[str]:
        return set(self.pending)

    @hookimpl
    async def delete_restored(self, episode_ids: list[EpisodeId]) -> None:
        self.calls.append(("delete_restored", {"episode_ids": [e.capture_key for e in episode_ids]}))
        if self.delete_gate is not None:
            await self.delete_gate.hold()
        if self.delete_error is not None:
            raise self.delete_error
        for episode in episode_ids:
            self.episodes.pop(episode.capture_key, None)
            self.pending.discard(episode.capture_key)

    @hookimpl
    async def install(self, checkpoint_id: str, manifest: Mapping[str, Any], records: list[Any]) -> None:
        self.calls.append(("install", {"checkpoint_id": checkpoint_id, "records": records, "manifest": manifest}))
        for restored in records:
            key = restored.replacement.capture_key
            self.episodes[key] = {**restored.record, "episode_id": wire(key)}
            self.pending.add(key)
        if self.install_gate is not None:
            await self.install_gate.hold()
        if self.install_error is not None:
            raise self.install_error

    @hookimpl
    async def retire(self, episode_ids: list[EpisodeId]) -> None:
        self.calls.append(("retire", {"episode_ids": [e.capture_key for e in episode_ids]}))
        if self.retire_gate is not None:
            await self.retire_gate.hold()
        for episode in episode_ids:
            self.episodes.pop(episode.capture_key, None)

    @hookimpl
    def forgotten(self, rollout_ids: list[str]) -> None:
        self.calls.append(("forgotten", {"rollout_ids": list(rollout_ids)}))

    @hookimpl
    def seed_session(self, episode_id: EpisodeId, session: Mapping[str, Any]) -> SeedDeclaration | None:
        self.calls.append(("seed_session", {"episode_id": episode_id.capture_key, "session": dict(session)}))
        return self.seed

    @hookimpl
    def status_fields(self) -> dict[str, Any]:
        return {"held_episodes": len(self.episodes), "kind": "must-not-override"}


class FailingStorage(LocalStorage):
    """The local backend, except that the next ``fail_writes`` writes fail as a full disk would.

    A failing writer consumes every record first (so a retry must replay what it consumed), then
    raises ``WriteFailed``; ``consumed`` holds what each failed write was given.
    """

    def __init__(self, fail_writes: int = 0) -> None:
        self.fail_writes = fail_writes
        self.consumed: list[list[dict[str, Any]]] = []

    def open_writer(self, checkpoint_dir: str | Path, kind: str, instance: str, checkpoint_id: str) -> Any:
        if self.fail_writes <= 0:
            return super().open_writer(checkpoint_dir, kind, instance, checkpoint_id)
        self.fail_writes -= 1
        return _FullDiskWriter(self, Path(checkpoint_dir))


class _FullDiskWriter:
    def __init__(self, storage: FailingStorage, checkpoint_dir: Path) -> None:
        self._storage = storage
        self._dir = checkpoint_dir

    def stop(self) -> bool:
        return False

    def write(self, records: Iterable[Mapping[str, Any]], extras: Mapping[str, Any] | None = None) -> dict:
        self._storage.consumed.append([dict(record) for record in records])
        raise WriteFailed(f"{self._dir}: no space left on device (ENOSPC) while storing records", path=str(self._dir))


class HookRecorder:
    """Every hook call on a manager, by name (pluggy's hook-call monitoring)."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.names: list[str] = []
        pm.add_hookcall_monitoring(self._before, lambda *_a: None)

    def _before(self, hook_name: str, _impls: Any, _kwargs: Mapping[str, Any]) -> None:
        self.names.append(hook_name)


@dataclass
class Harness:
    participant: Participant
    pm: pluggy.PluginManager
    plane: ControlPlane
    app: FastAPI
    client: httpx.AsyncClient
    recorder: HookRecorder
    directory: Path

    async def post(self, route: str, body: Mapping[str, Any], headers: Mapping[str, str] = AUTH) -> httpx.Response:
        return await self.client.post(f"{CONTROL_PREFIX}/{route}", json=dict(body), headers=dict(headers))

    async def call(self, route: str, expect: int = 200, **body: Any) -> dict[str, Any]:
        """POST ``body`` (``deadline_ts`` defaults to 10 s from now) and check the status code."""
        body.setdefault("deadline_ts", deadline())
        response = await self.post(route, body)
        assert response.status_code == expect, (route, response.status_code, response.text)
        return response.json()

    async def error(self, route: str, code: str, **body: Any) -> dict[str, Any]:
        body.setdefault("deadline_ts", deadline())
        response = await self.post(route, body)
        payload = response.json()
        assert payload.get("error", {}).get("code") == code, (route, response.status_code, payload)
        return payload["error"]

    async def status(self) -> dict[str, Any]:
        response = await self.client.get(f"{CONTROL_PREFIX}/status", headers=AUTH)
        assert response.status_code == 200, response.text
        return response.json()

    async def checkpoint(self, checkpoint_id: str, scope: list[str] | None, **extra: Any) -> dict[str, Any]:
        await self.call("prepare", checkpoint_id=checkpoint_id)
        return await self.call(
            "commit",
            checkpoint_id=checkpoint_id,
            checkpoint_dir=str(self.directory),
            episode_ids=None if scope is None else [wire(k) for k in scope],
            **extra,
        )


Factory = Callable[..., Awaitable[Harness]]


async def make_harness(
    tmp_path: Path,
    participant: Participant | None = None,
    *,
    retry_seconds: float = 30.0,
    grace_seconds: float = 600.0,
    extra_plugins: tuple[Any, ...] = (),
    named_plugins: Mapping[str, Any] | None = None,
    clock: Callable[[], float] = time.time,
    storage: Any = None,
    limits: BodyLimits | None = None,
    instance: str = INSTANCE,
) -> Harness:
    participant = participant or Participant()
    pm = make_plugin_manager([participant, *extra_plugins], load_entry_points=False, named_plugins=named_plugins)
    recorder = HookRecorder(pm)
    plane = ControlPlane(
        pm,
        kind=KIND,
        instance=instance,
        lease_policy=LeasePolicy(grace_seconds=grace_seconds, retry_seconds=retry_seconds),
        clock=clock,
        storage=storage,
    )
    app = FastAPI()
    attach(app, plane, TOKEN, limits=limits)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://control.test")
    return Harness(participant, pm, plane, app, client, recorder, tmp_path / "ckpt")


async def close_harness(harness: Harness) -> None:
    await harness.client.aclose()
    await harness.plane.aclose()
