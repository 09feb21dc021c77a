"""The participant plugin of a server with several workers: every hook fanned out over the roster.

The main process's ``ControlPlane`` holds this plugin (``Coordinator.participant``) as its one
participant; the plane keeps phases, fencing, lease, storage and the retired marks, this plugin
makes the workers follow:

- ``close_admission`` closes admission on every worker and waits for each acknowledgement; a
  worker's refusal aborts (the plane reopens everywhere), a worker that did not acknowledge blocks;
- ``ready`` merges every worker's readiness as the worker last pushed it (never waiting on a
  worker: the hookspec), plus the roster's blockers and the workers that have not confirmed
  admission closed for this checkpoint, as ``worker_blockers`` (never capture keys); a worker
  whose report is missing or for another checkpoint blocks, naming it;
- ``export`` is the union of every worker's records and the unclaimed restored ones, one record per
  episode and owner (``merge_records``: a model server's calls of one episode answered by several
  workers are exported by each); ``export_failed`` when a worker was lost during the checkpoint,
  its export failed or two workers' records of one episode disagree;
- ``install`` holds the restored records here until a worker claims one, and relays the
  restore's marks to every worker. This plugin is a relay (``_control.facade.RELAY_ATTRIBUTE``): the
  records of a worker's third-party plugins keep the owner the worker's facade tagged, a restore
  hands all of them here, and every worker must install each record's plugin (checked first);
- ``retire`` sends the marks to every worker first, then has every worker stop and free the
  attempts, and returns when all did (a worker that is gone has stopped); ``forgotten`` is relayed.

The restore refusal once a worker left is the plane's (``Coordinator.bind``), before any mark.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nemo_gym_checkpoint_plugin._control.facade import OWNER_FIELD, RelayedExport
from nemo_gym_checkpoint_plugin._errors import CheckpointError, ExportFailed, InvalidCheckpointState
from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._markers import hookimpl
from nemo_gym_checkpoint_plugin._types import Readiness, RestoredRecord, merge_readiness

from . import messages as m
from .link import LinkClosed
from .roster import WorkerAnswers

if TYPE_CHECKING:
    from .coordinator import Coordinator

__all__ = ["WorkersParticipant", "merge_extras", "merge_records"]

logger = logging.getLogger(__name__)


def merge_extras(extras: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The workers' export extras as one: equal values once, numbers summed, objects merged; else ``ValueError``."""
    merged: dict[str, Any] = {}
    for one in extras:
        for key, value in one.items():
            if key not in merged:
                merged[key] = value
            elif merged[key] == value and type(merged[key]) is type(value) and not _number(value):
                continue
            elif _number(value) and _number(merged[key]):
                merged[key] = merged[key] + value
            elif isinstance(value, Mapping) and isinstance(merged[key], Mapping):
                merged[key] = merge_extras([merged[key], value])
            else:
                raise ValueError(f"the workers' exports disagree on the extra {key!r}")
    return merged


def _number(value: Any) -> bool:
    return type(value) in (int, float)


def merge_records(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One record per episode and owner: records several workers exported for one episode, merged.

    A checkpoint holds one record per episode and owner (a restore refuses a capture key twice). Each
    worker exports what it holds of an episode; only the model server's calls of one episode land on
    several workers (its token capture rows: each worker owns the calls it answered). Their records
    merge field by field: lists concatenated in the order given, objects merged, equal values kept;
    any other difference is ``ValueError`` naming the episode and the field. A record without a valid
    ``episode_id`` is left as it is (the writer refuses it). Order is kept: a merged record takes the
    place of its episode's first.
    """
    first: dict[tuple[Any, Any, Any], int] = {}
    out: list[Mapping[str, Any]] = []
    for record in records:
        episode = record.get("episode_id")
        try:
            key = (record.get(OWNER_FIELD), episode["rollout_id"], episode["attempt"])  # type: ignore[index]
            hash(key)
        except (TypeError, KeyError):
            out.append(record)
            continue
        at = first.get(key)
        if at is None:
            first[key] = len(out)
            out.append(record)
        else:
            out[at] = _merged(out[at], record, f"{key[1]}/{key[2]}")
    return out


def _merged(one: Mapping[str, Any], other: Mapping[str, Any], where: str) -> dict[str, Any]:
    merged = dict(one)
    for name, value in other.items():
        if name not in merged:
            merged[name] = value
            continue
        mine = merged[name]
        if type(mine) is list and type(value) is list:
            merged[name] = mine + value
        elif isinstance(mine, Mapping) and isinstance(value, Mapping):
            merged[name] = _merged(mine, value, f"{where}.{name}")
        elif not (type(mine) is type(value) and mine == value):
            raise ValueError(f"the workers' records of episode {where} disagree on {name!r}")
    return merged


def _refusal(answers: WorkerAnswers) -> CheckpointError | None:
    for name in sorted(answers.failures):
        failure = answers.failures[name]
        if isinstance(failure, CheckpointError):
            return failure
    return None


def _troubles(answers: WorkerAnswers) -> dict[str, Exception]:
    """Failures other than a worker gone (the roster accounts for those) and other than refusals."""
    return {
        name: failure
        for name, failure in answers.failures.items()
        if not isinstance(failure, LinkClosed | CheckpointError)
    }


def _detail(failure: Exception) -> str:
    return str(getattr(failure, "detail", None) or failure)


class WorkersParticipant:
    """The participant hooks of a server with several workers (see the module docstring)."""

    # facade.RELAY_ATTRIBUTE: the workers' facades tag third-party records and split them on install.
    relays_worker_plugins = True

    def __init__(self, coordinator: Coordinator) -> None:
        self._c = coordinator
        # Workers that failed to acknowledge a step of the active checkpoint: name -> why (a blocker).
        self._unacknowledged: dict[str, str] = {}

    async def _all(self, op: str, body: Any, *, work: bool = False) -> WorkerAnswers:
        timeout = self._c.work_timeout if work else self._c.call_timeout
        return await self._c.roster.broadcast(op, body, timeout=timeout)

    async def _acknowledged(self, op: str, checkpoint_id: str, body: Any) -> None:
        answers = await self._all(op, body)
        refusal = _refusal(answers)
        if refusal is not None:
            raise refusal
        for name, failure in _troubles(answers).items():
            self._unacknowledged[name] = f"{name} did not acknowledge {op} of {checkpoint_id}: {_detail(failure)}"

    async def _everywhere(self, op: str, body: Any, *, work: bool = False) -> WorkerAnswers:
        """``op`` on every worker; raise the first refusal, or one error naming the workers that failed."""
        answers = await self._all(op, body, work=work)
        refusal = _refusal(answers)
        if refusal is not None:
            raise refusal
        troubles = _troubles(answers)
        if troubles:
            named = "; ".join(f"{name}: {_detail(failure)}" for name, failure in sorted(troubles.items()))
            raise RuntimeError(f"{op} failed on {len(troubles)} worker(s): {named}")
        return answers

    # -- admission and readiness -----------------------------------------------------------------

    @hookimpl
    async def close_admission(self, checkpoint_id: str) -> None:
        self._c.closed_for = checkpoint_id
        self._c.roster.begin(checkpoint_id)
        self._unacknowledged.clear()
        await self._acknowledged(m.CLOSE_ADMISSION, checkpoint_id, {"checkpoint_id": checkpoint_id})

    @hookimpl
    async def preparing(self, checkpoint_id: str, deadline_ts: float) -> None:
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts}
        await self._acknowledged(m.PREPARING, checkpoint_id, body)

    @hookimpl
    async def open_admission(self, checkpoint_id: str) -> None:
        self._c.closed_for = None
        self._c.roster.end(checkpoint_id)
        self._unacknowledged.clear()
        await self._everywhere(m.OPEN_ADMISSION, {"checkpoint_id": checkpoint_id})

    @hookimpl
    async def ready(self, checkpoint_id: str | None) -> Readiness:
        """From memory, never waiting on a worker (the hookspec): what each worker last pushed (``worker.py``).

        A connected worker blocks while its last report is for another checkpoint (or none came yet),
        failed, or does not say admission is closed for this one.
        """
        found: list[Readiness] = [self._c.roster.readiness(checkpoint_id)]
        named: list[str] = list(self._unacknowledged.values())
        closing = checkpoint_id is not None and self._c.closed_for == checkpoint_id
        for name in self._c.roster.connected:
            body = self._c.readiness.get(name)
            if body is None or body.get("checkpoint_id") != checkpoint_id:
                named.append(f"{name} has not reported its readiness for {checkpoint_id or 'status'} yet")
                continue
            if body.get("error") is not None:
                named.append(f"{name} failed to report its readiness: {body['error']}")
                continue
            if closing and body.get("closed_for") != checkpoint_id:
                named.append(f"{name} has not closed admission for {checkpoint_id}")
            found.append(m.readiness_from_wire(body))
        report = merge_readiness([*found, Readiness(worker_blockers=named)])
        return Readiness(report.blockers, report.restarts, report.counts, report.worker_blockers)

    @hookimpl
    async def wait_ready(self, checkpoint_id: str) -> None:
        """Return when a worker pushed its readiness, came or went; at most ``poll_seconds``."""
        await self._c.readiness_changed(self._c.poll_seconds)

    # -- export and what follows a commit --------------------------------------------------------

    def _lost(self, checkpoint_id: str) -> None:
        lost = self._c.roster.lost_during(checkpoint_id)
        if lost:
            raise ExportFailed(
                f"{', '.join(lost)} disconnected during {checkpoint_id}: what it held is gone, so this "
                "server cannot export a complete cut; the checkpoint is over: resume it and prepare a new id",
                workers=list(lost),
            )

    @hookimpl
    async def export(self, checkpoint_id: str, scope: frozenset[str] | None) -> RelayedExport:
        self._lost(checkpoint_id)
        body = {"checkpoint_id": checkpoint_id, "scope": None if scope is None else sorted(scope)}
        answers = await self._all(m.EXPORT, body, work=True)
        self._lost(checkpoint_id)
        refusal = _refusal(answers)
        if refusal is not None:
            raise refusal
        if answers.failures:
            named = "; ".join(f"{name}: {_detail(failure)}" for name, failure in sorted(answers.failures.items()))
            raise ExportFailed(f"the export of {checkpoint_id} failed on a worker ({named}); the checkpoint is over")
        if len(answers.replies) < self._c.roster.expected:
            raise ExportFailed(
                f"only {len(answers.replies)} of {self._c.roster.expected} workers exported {checkpoint_id}; "
                "the checkpoint is over"
            )
        replies = [answers.replies[name] for name in sorted(answers.replies)]
        records: list[Mapping[str, Any]] = [record for reply in replies for record in reply["records"]]
        records.extend(self._c.restored.exported(scope))
        try:
            records = merge_records(records)
            manifest = merge_extras([reply["manifest_extras"] for reply in replies])
            extras = merge_extras([reply["reply_extras"] for reply in replies])
        except ValueError as exc:
            raise ExportFailed(f"the export of {checkpoint_id}: {exc}") from None
        return RelayedExport(records=records, manifest_extras=manifest, reply_extras=extras)

    @hookimpl
    async def release_exported(self, checkpoint_id: str, episode_keys: list[str]) -> None:
        body = {"checkpoint_id": checkpoint_id, "episode_keys": list(episode_keys)}
        await self._everywhere(m.RELEASE_EXPORTED, body, work=True)

    @hookimpl
    async def restored_pending(self) -> set[str]:
        keys = self._c.restored.pending()
        answers = await self._all(m.RESTORED_PENDING, None)
        for name, failure in answers.failures.items():
            logger.warning("%s did not say which restored episodes it holds: %s", name, _detail(failure))
        for reply in answers.replies.values():
            keys.update(str(key) for key in reply)
        return keys

    @hookimpl
    async def delete_restored(self, episode_ids: list[EpisodeId]) -> None:
        self._c.restored.drop(episode.capture_key for episode in episode_ids)
        await self._everywhere(m.DELETE_RESTORED, {"episodes": m.episodes_to_wire(episode_ids)}, work=True)

    # -- restore, retire, forget -----------------------------------------------------------------

    @hookimpl
    async def install(
        self, checkpoint_id: str, manifest: Mapping[str, Any], records: list[RestoredRecord], scope: list[EpisodeId]
    ) -> None:
        owners = sorted({str(r.record[OWNER_FIELD]) for r in records if r.record.get(OWNER_FIELD) is not None})
        if owners:
            # Before anything is held: every worker must have each record's plugin, whichever claims it.
            answers = await self._everywhere(m.CHECK_OWNERS, {"owners": owners})
            for name, missing in sorted(answers.replies.items()):
                if missing:
                    raise InvalidCheckpointState(
                        f"restore {checkpoint_id}: records belong to plugin(s) {', '.join(missing)}, "
                        f"which {name} does not install",
                        plugin=missing[0],
                    )
        # Every worker refuses the checkpointed attempts before any replacement can arrive at one.
        checkpointed = [[episode.rollout_id, episode.attempt - 1] for episode in scope]
        # With the marks, the replacements whose records are held here: their first request claims them.
        restored = sorted({r.replacement.capture_key for r in records})
        self._c.restored.hold(checkpoint_id, manifest, records)
        try:
            await self._everywhere(m.MARK, {"episodes": checkpointed, "restored": restored})
        except BaseException:
            self._c.restored.drop(restored)
            raise

    @hookimpl
    async def retire(self, episode_ids: list[EpisodeId]) -> None:
        self._c.restored.drop_retired(episode_ids)
        body = {"episodes": m.episodes_to_wire(episode_ids)}
        # Marks first, on every worker: none stops work while another would still admit the attempt.
        await self._everywhere(m.MARK, body)
        await self._everywhere(m.RETIRE, body, work=True)

    @hookimpl
    async def forgotten(self, rollout_ids: list[str]) -> None:
        await self._everywhere(m.FORGET, {"rollout_ids": list(rollout_ids)})

    @hookimpl
    async def status_fields(self) -> dict[str, Any]:
        """The workers' participant fields merged as their exports' extras are (counts summed, objects
        merged), and ``workers``; a worker not answering within the call timeout is named in its
        ``unanswered`` list."""
        roster = self._c.roster
        answers = await self._all(m.STATUS_FIELDS, None)
        replies = [answers.replies[name] for name in sorted(answers.replies)]
        try:
            fields = merge_extras(replies)
        except ValueError as exc:
            fields = {"workers_status_fields": {name: answers.replies[name] for name in sorted(answers.replies)}}
            logger.warning("the workers' status fields disagree (%s); each worker's are shown", exc)
        fields["workers"] = {
            "expected": roster.expected,
            "connected": list(roster.connected),
            "left": list(roster.left),
            **({"unanswered": sorted(answers.failures)} if answers.failures else {}),
        }
        return fields
