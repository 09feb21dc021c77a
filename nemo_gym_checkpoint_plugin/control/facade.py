"""Typed, keyword-only calls of the participant hooks, awaiting whatever a hook returns.

pluggy is synchronous: an ``async def`` implementation returns a coroutine, which the
caller awaits (``maybe_awaitable``). Collected hooks are awaited one after the other
unless a contract says the calls are independent (``wait_ready``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import pluggy

from nemo_gym_checkpoint_plugin.identity import EpisodeId

from .types import ParticipantExport, PrepareReport, Readiness, RestoredRecord, SeedDeclaration, merge_readiness

__all__ = ["Participants", "maybe_awaitable", "merge_exports"]

logger = logging.getLogger(__name__)

# Without any wait_ready implementation, prepare re-asks ready this often (only while preparing).
POLL_SECONDS = 0.02


async def maybe_awaitable(value: Any) -> Any:
    """Await ``value`` if a hook returned an awaitable, else return it as is."""
    if inspect.isawaitable(value):
        return await value
    return value


async def _all(results: list[Any]) -> list[Any]:
    return [await maybe_awaitable(result) for result in results]


def merge_exports(answers: Iterable[Any]) -> ParticipantExport:
    """Chain the records of every plugin's export; merge extras, refusing a key two plugins set."""
    sources: list[Iterable[Mapping[str, Any]]] = []
    manifest: dict[str, Any] = {}
    reply: dict[str, Any] = {}
    for answer in answers:
        if answer is None:
            continue
        if not isinstance(answer, ParticipantExport):
            answer = ParticipantExport(records=answer)
        sources.append(answer.records)
        for target, extras in ((manifest, answer.manifest_extras), (reply, answer.reply_extras)):
            for key, value in extras.items():
                if key in target:
                    raise ValueError(f"two export plugins set the extra {key!r}")
                target[key] = value

    def chained() -> Iterable[Mapping[str, Any]]:
        for source in sources:
            yield from source

    return ParticipantExport(records=chained(), manifest_extras=manifest, reply_extras=reply)


class Participants:
    """The participant hooks of one manager, called with keyword arguments."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self._hook = pm.hook

    async def close_admission(self, checkpoint_id: str) -> None:
        await _all(self._hook.close_admission(checkpoint_id=checkpoint_id))

    async def open_admission(self, checkpoint_id: str) -> None:
        await _all(self._hook.open_admission(checkpoint_id=checkpoint_id))

    async def ready(self, checkpoint_id: str | None) -> PrepareReport:
        answers: list[Readiness | None] = await _all(self._hook.ready(checkpoint_id=checkpoint_id))
        return merge_readiness(answers)

    async def wait_ready(self, checkpoint_id: str) -> None:
        """Return when any implementation returned (the others are cancelled); poll without any."""
        waiters = [asyncio.ensure_future(r) for r in self._hook.wait_ready(checkpoint_id=checkpoint_id)
                   if inspect.isawaitable(r)]
        if not waiters:
            await asyncio.sleep(POLL_SECONDS)  # wait-ok: no plugin can signal a change, so re-ask ready soon
            return
        try:
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in waiters:
                task.cancel()

    async def export(self, checkpoint_id: str, scope: frozenset[str] | None) -> ParticipantExport:
        return merge_exports(await _all(self._hook.export(checkpoint_id=checkpoint_id, scope=scope)))

    async def release_exported(self, checkpoint_id: str, episode_keys: list[str]) -> None:
        await _all(self._hook.release_exported(checkpoint_id=checkpoint_id, episode_keys=episode_keys))

    async def restored_pending(self) -> set[str]:
        keys: set[str] = set()
        for answer in await _all(self._hook.restored_pending()):
            if answer is not None:
                keys.update(answer)
        return keys

    async def delete_restored(self, episode_ids: list[EpisodeId]) -> None:
        await _all(self._hook.delete_restored(episode_ids=episode_ids))

    async def install(self, checkpoint_id: str, manifest: Mapping[str, Any], records: list[RestoredRecord]) -> None:
        await _all(self._hook.install(checkpoint_id=checkpoint_id, manifest=manifest, records=records))

    async def retire(self, episode_ids: list[EpisodeId]) -> None:
        await _all(self._hook.retire(episode_ids=episode_ids))

    async def seed_session(self, episode_id: EpisodeId, session: Mapping[str, Any]) -> dict[str, str]:
        """The reply headers every plugin's declaration adds up to (empty: nothing to declare)."""
        declarations = [
            d for d in await _all(self._hook.seed_session(episode_id=episode_id, session=session)) if d is not None
        ]
        headers: dict[str, str] = {}
        if any(d.restart for d in declarations):
            headers["x-ng-checkpoint-restart"] = "1"
        if declarations and all(isinstance(d, SeedDeclaration) and d.verify_replay for d in declarations):
            headers["x-ng-checkpoint-verify"] = "replay"
        return headers

    async def status_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for answer in await _all(self._hook.status_fields()):
            if answer:
                fields.update(answer)
        return fields
