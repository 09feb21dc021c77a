"""Typed, keyword-only calls of the participant hooks, awaiting whatever a hook returns.

pluggy is synchronous: an ``async def`` implementation returns a coroutine, which the
caller awaits (``maybe_awaitable``). Collected hooks are awaited one after the other
unless a contract says the calls are independent (``wait_ready``).

Records are owned (docs/protocol.md, "On-disk format"): the participant's own plugins (its
built-in participant, plugins handed to ``make_plugin_manager``) write records without a
``"plugin"`` field; a third-party plugin (loaded from the entry-point group, or registered by
name) has its records tagged ``"plugin": <its registered name>``. A restore hands each plugin
only its own records plus the whole scope; a record naming a plugin that is not here is
``invalid_checkpoint_state``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import pluggy

from nemo_gym_checkpoint_plugin._errors import ExportFailed, InvalidCheckpointState
from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._wire import RESTART_HEADER, VERIFY_HEADER

from .._types import (
    ParticipantExport,
    PrepareReport,
    Readiness,
    RestoredRecord,
    SeedDeclaration,
    Versioned,
    merge_readiness,
)

__all__ = [
    "OWNER_FIELD",
    "RELAY_ATTRIBUTE",
    "Participants",
    "RelayedExport",
    "claim_install",
    "maybe_awaitable",
    "merge_exports",
    "third_party_names",
]

logger = logging.getLogger(__name__)

# The record field naming a third-party plugin that exported it (absent: the participant's own plugins).
OWNER_FIELD = "plugin"

# A plugin object with this attribute true relays other processes' plugins (the coordinator of a server
# with several workers, ``_workers/fanout.py``): its records keep the owners the workers tagged, and a
# restore hands it every record (the workers' own facades split them by owner when they install).
RELAY_ATTRIBUTE = "relays_worker_plugins"


class RelayedExport(ParticipantExport):
    """A relay's export: records already owned (tagged by the facade of the process that made them)."""


# True while the install hooks run for a worker's claim of one replacement (``Participants.install(claimed=True)``).
_CLAIM_INSTALL: ContextVar[bool] = ContextVar("ng_checkpoint_claim_install", default=False)


def claim_install() -> bool:
    """Whether the ``install`` hook now running is a worker's claim rather than a restore's install.

    On a server with several workers (docs/protocol.md, "Several workers") a restore installs nothing
    in any worker: the worker that receives a replacement's first request claims its records and
    installs them then, after the restore resumed, with that one episode as the scope, while the
    worker may be serving other episodes. A participant whose install does restore-wide work (once
    per restore, or only into a process that served nothing) tells the two apart with this.
    """
    return _CLAIM_INSTALL.get()


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


def third_party_names(pm: pluggy.PluginManager) -> frozenset[str]:
    """Registered names of ``pm``'s third-party plugins (``_plugins.make_plugin_manager`` records them)."""
    return frozenset(getattr(pm, "third_party_names", ()))


def _own_records(records: Iterable[Any]) -> Iterator[Any]:
    """The participant's own records pass as they are; the owner field is reserved for third parties."""
    for record in records:
        if type(record) is Versioned:
            if record.plugin is not None:
                raise ExportFailed(
                    f"a versioned record of the participant's own plugins names plugin {record.plugin!r}"
                )
            yield record  # its record, once built, is checked by the writer (it names its episode)
            continue
        # Records are plain dicts as a rule: the exact type test first (an ABC check costs more, per record).
        if (type(record) is dict or isinstance(record, Mapping)) and OWNER_FIELD in record:
            raise ExportFailed(
                f"a record of the participant's own plugins sets {OWNER_FIELD!r}, which names third-party owners"
            )
        yield record


def _tagged_records(records: Iterable[Any], owner: str) -> Iterator[Any]:
    for record in records:
        if type(record) is Versioned:
            if record.plugin not in (None, owner):
                raise ExportFailed(f"plugin {owner!r} exported a record naming another owner, {record.plugin!r}")
            # The writer tags the record with its plugin when it builds it (never, when it is referred to).
            yield Versioned(record.episode_id, record.version, record.record, owner)
            continue
        if type(record) is dict or isinstance(record, Mapping):
            named = record.get(OWNER_FIELD, owner)
            if named != owner:
                raise ExportFailed(f"plugin {owner!r} exported a record naming another owner, {named!r}")
            if OWNER_FIELD not in record:
                record = {**record, OWNER_FIELD: owner}
        yield record


def _owned(answer: Any, owner: str | None) -> ParticipantExport | None:
    if answer is None:
        return None
    if owner is None and isinstance(answer, RelayedExport):
        return answer
    if not isinstance(answer, ParticipantExport):
        answer = ParticipantExport(records=answer)
    records = _own_records(answer.records) if owner is None else _tagged_records(answer.records, owner)
    return ParticipantExport(records=records, manifest_extras=answer.manifest_extras, reply_extras=answer.reply_extras)


def _direct(impls: list[Any]) -> Any:
    """Call hook implementations with the keyword arguments each declares, as pluggy does; their answers."""

    def call(**kwargs: Any) -> list[Any]:
        answers = [impl.function(*[kwargs[arg] for arg in impl.argnames]) for impl in impls]
        return [answer for answer in answers if answer is not None]

    return call


class Participants:
    """The participant hooks of one manager, called with keyword arguments."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self._pm = pm
        self._hook = pm.hook
        self._third_party = third_party_names(pm)
        # list_name_plugin, not get_plugins: that builds a set, and a plugin need not be hashable.
        self._relays = any(getattr(plugin, RELAY_ATTRIBUTE, False) is True for _, plugin in pm.list_name_plugin())

    def _owners(self, name: str) -> list[tuple[str | None, Any]]:
        """``(owner, call)`` pairs for hook ``name``: the own plugins at once (owner None), then each third party.

        Without third-party implementations this is the plain hook. With them, every
        implementation is called directly, in pluggy's order (each third party gets only its own
        records); pluggy's ``subset_hook_caller`` would need every plugin to be hashable.
        """
        hook = getattr(self._hook, name)
        impls = hook.get_hookimpls()
        if not any(impl.plugin_name in self._third_party for impl in impls):
            return [(None, hook)]
        # pluggy calls the last registered first; tryfirst/trylast are already in the list's order.
        ordered = list(reversed(impls))
        own = [impl for impl in ordered if impl.plugin_name not in self._third_party]
        callers: list[tuple[str | None, Any]] = [(None, _direct(own))]
        for impl in ordered:
            if impl.plugin_name in self._third_party:
                callers.append((impl.plugin_name, _direct([impl])))
        return callers

    def missing_owners(self, owners: Iterable[str]) -> list[str]:
        """Of these record owners (third-party plugin names), those no install hook here takes."""
        installers = {owner for owner, _ in self._owners("install")}
        return sorted(set(owners) - installers)

    def check_owners(self, records: Iterable[RestoredRecord]) -> None:
        """Refuse (``InvalidCheckpointState``) records owned by a plugin this server does not have.

        A relay checks in the processes it relays to (its install hook): nothing is refused here.
        """
        if self._relays:
            return
        installers = {owner for owner, _ in self._owners("install")}
        for restored in records:
            owner = restored.record.get(OWNER_FIELD)
            if owner is None or owner in installers:
                continue
            what = "implements no install hook" if owner in self._third_party else "is not installed on this server"
            raise InvalidCheckpointState(
                f"the record of episode {restored.checkpointed.capture_key} belongs to plugin {owner!r}, which {what}",
                plugin=str(owner),
                episode=restored.checkpointed.capture_key,
            )

    async def close_admission(self, checkpoint_id: str) -> None:
        await _all(self._hook.close_admission(checkpoint_id=checkpoint_id))

    async def preparing(self, checkpoint_id: str, deadline_ts: float) -> None:
        await _all(self._hook.preparing(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts))

    async def open_admission(self, checkpoint_id: str) -> None:
        await _all(self._hook.open_admission(checkpoint_id=checkpoint_id))

    async def ready(self, checkpoint_id: str | None) -> PrepareReport:
        answers: list[Readiness | None] = await _all(self._hook.ready(checkpoint_id=checkpoint_id))
        return merge_readiness(answers)

    async def wait_ready(self, checkpoint_id: str) -> None:
        """Return when any implementation returned (the others are cancelled); poll without any."""
        waiters = [
            asyncio.ensure_future(r)
            for r in self._hook.wait_ready(checkpoint_id=checkpoint_id)
            if inspect.isawaitable(r)
        ]
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
        owned: list[ParticipantExport | None] = []
        for owner, caller in self._owners("export"):
            answers = await _all(caller(checkpoint_id=checkpoint_id, scope=scope))
            owned.extend(_owned(answer, owner) for answer in answers)
        return merge_exports(owned)

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

    async def install(
        self,
        checkpoint_id: str,
        manifest: Mapping[str, Any],
        records: list[RestoredRecord],
        scope: Sequence[EpisodeId],
        *,
        claimed: bool = False,
    ) -> None:
        """Hand each plugin its own records and the whole ``scope`` (replacement attempts).

        ``claimed``: a worker's claim of one replacement, not a restore (``claim_install``).
        """
        self.check_owners(records)
        mine: dict[str | None, list[RestoredRecord]] = {}
        for restored in records:
            # A relay (the participant's own plugin) takes every record, whoever owns it.
            owner = None if self._relays else restored.record.get(OWNER_FIELD)
            mine.setdefault(owner, []).append(restored)
        token = _CLAIM_INSTALL.set(claimed)
        try:
            for owner, caller in self._owners("install"):
                await _all(
                    caller(checkpoint_id=checkpoint_id, manifest=manifest, records=mine.get(owner, []), scope=scope)
                )
        finally:
            _CLAIM_INSTALL.reset(token)

    async def retire(self, episode_ids: list[EpisodeId]) -> None:
        await _all(self._hook.retire(episode_ids=episode_ids))

    async def forgotten(self, rollout_ids: list[str]) -> None:
        await _all(self._hook.forgotten(rollout_ids=rollout_ids))

    async def seed_session(self, episode_id: EpisodeId, session: Mapping[str, Any]) -> dict[str, str]:
        """The reply headers every plugin's declaration adds up to (empty: nothing to declare)."""
        declarations = [
            d for d in await _all(self._hook.seed_session(episode_id=episode_id, session=session)) if d is not None
        ]
        headers: dict[str, str] = {}
        if any(d.restart for d in declarations):
            headers[RESTART_HEADER] = "1"
        if declarations and all(isinstance(d, SeedDeclaration) and d.verify_replay for d in declarations):
            headers[VERIFY_HEADER] = "replay"
        return headers

    async def status_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for answer in await _all(self._hook.status_fields()):
            if answer:
                fields.update(answer)
        return fields
