"""``checkpoint_now``: one checkpoint of a running deployment, at once, bounded by a budget.

What a controller does with a preemption notice (a SIGTERM, a drain notice: 30-120 s of warning):
``prepare``, ``commit`` the rollouts in flight (minus the restarts) into a directory, publish, then
``resume``, all within ``budget`` seconds. ``ng-checkpoint collect`` takes every checkpoint, periodic
or on SIGTERM, through this function (``_checkpointer.CollectionCheckpointer.checkpoint``), so there
is one copy of the sequence.

- The budget bounds prepare, commit and publish together: each call's deadline is the budget's end
  (or ``timeout`` from the call, when sooner), and the whole runs under ``asyncio.timeout`` so a
  participant that never replies cannot outlast it. When the budget ends first, nothing is published
  (``published`` false, ``out_of_time`` true): a commit cut short leaves a directory without a
  participants index (or without the collector's manifest), which no restore takes.
- ``resume`` always follows, whatever happened (within ``resume_timeout``, past the budget): a
  deployment is never left with admission closed.
- Cancelling the task that awaits it (a second SIGTERM) stops at once: nothing more is published,
  the deployment is resumed, and ``CancelledError`` propagates.
- ``publish`` (optional) is the caller's own last step after the commit (``collect`` writes its
  state and its manifest there); without it the commit, whose participants index is written last,
  is the publication. A ``publish`` that makes the checkpoint visible in one step may set
  ``result.published`` itself as it does, so an interruption right after it is reported as it is.

Failures of a participant (``CoordinationError``) or of the storage (``InvalidCheckpointState``)
come back in the result (``problem``, ``error``), never raised: the caller decides what to do with a
checkpoint that did not happen.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._errors import InvalidCheckpointState
from ._coordinator import DEFAULT_TIMEOUT, Coordinator
from ._errors import CoordinationError
from ._results import CommitResult, PrepareResult

__all__ = ["DEFAULT_BUDGET", "CheckpointNow", "checkpoint_now"]

logger = logging.getLogger(__name__)

DEFAULT_BUDGET = 30.0
# Seconds the resume after a checkpoint may take (it runs past the budget: admission must reopen).
RESUME_TIMEOUT = 10.0

Observer = Callable[[str, dict[str, Any]], Any]


@dataclass
class CheckpointNow:
    """What one ``checkpoint_now`` did."""

    checkpoint_id: str
    budget: float | None = None
    published: bool = False
    checkpoint_dir: str | None = None
    scope: list[dict[str, Any]] = field(default_factory=list)
    prepared: PrepareResult | None = None
    committed: CommitResult | None = None
    prepare_s: float = 0.0
    commit_s: float = 0.0
    # From the prepare to the end of the resume: how long the deployment's admission was closed.
    paused_s: float = 0.0
    # The step running when the budget ended or the task was cancelled ("prepare", "commit", "publish").
    step: str | None = None
    out_of_time: bool = False
    cancelled: bool = False
    resumed: bool = False
    problem: str | None = None
    error: BaseException | None = None
    commit_started: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "published": self.published,
            "checkpoint_dir": self.checkpoint_dir,
            "episodes": len(self.scope),
            "budget_s": self.budget,
            "prepare_s": round(self.prepare_s, 3),
            "commit_s": round(self.commit_s, 3),
            "paused_s": round(self.paused_s, 3),
            "out_of_time": self.out_of_time,
            "resumed": self.resumed,
            "problem": self.problem,
        }


async def _emit(observe: Observer | None, event: str, **data: Any) -> None:
    if observe is not None:
        outcome = observe(event, data)
        if inspect.isawaitable(outcome):
            await outcome


async def checkpoint_now(
    coordinator: Coordinator,
    checkpoint_id: str,
    checkpoint_dir: str | os.PathLike[str] | Callable[[], Any],
    episode_ids: Iterable[Any] | Callable[[], Iterable[Any]],
    *,
    budget: float | None = DEFAULT_BUDGET,
    timeout: float | None = None,
    publish: Callable[[CheckpointNow], Awaitable[Mapping[str, Any] | None]] | None = None,
    observe: Observer | None = None,
    resume_timeout: float = RESUME_TIMEOUT,
) -> CheckpointNow:
    """Prepare, commit, publish and resume ``checkpoint_id`` now, within ``budget`` seconds (None: no bound).

    ``checkpoint_dir`` is the directory to commit into, or a callable that makes it and returns it
    (run in a thread once the deployment is prepared, so nothing is made for a checkpoint that never
    commits). ``episode_ids`` are the rollouts in flight (capture keys, wire dicts or ``EpisodeId``),
    or a callable giving them, read once the deployment is prepared (the rollouts whose ``/run``
    returned meanwhile are no longer in flight); the scope is them minus the restarts
    (``PrepareResult.continued``). ``timeout`` bounds each call on its own (default: the budget).
    ``observe(event, data)`` (may be async) sees ``prepare``, ``prepared``, ``skipped`` (not ready),
    ``committed`` and ``published``; ``publish``'s returned mapping is added to ``published``'s data.
    """
    result = CheckpointNow(checkpoint_id, budget=budget)
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    ends = None if budget is None else loop.time() + budget
    per_call = DEFAULT_TIMEOUT if timeout is None else timeout

    def deadline_ts() -> float:
        # The servers' deadline (wall clock): the budget's end, or the call's own timeout when sooner.
        left = per_call if ends is None else min(per_call, max(ends - loop.time(), 0.0))
        return time.time() + left

    bound = asyncio.timeout_at(ends)
    try:
        async with bound:
            await _steps(coordinator, result, checkpoint_dir, episode_ids, deadline_ts, publish, observe)
    except (CoordinationError, InvalidCheckpointState) as exc:
        result.error = exc
        result.problem = str(exc).splitlines()[0]
    except TimeoutError:
        if not bound.expired():
            raise  # not the budget's: something below timed out on its own
        result.out_of_time = True
        if not result.published:
            result.problem = f"the budget of {budget:g}s ended during the {result.step}; nothing was published"
    except asyncio.CancelledError:
        result.cancelled = True
        if not result.published:
            result.problem = f"stopped during the {result.step}; nothing was published"
        await _resume(coordinator, result, resume_timeout, started)
        raise
    await _resume(coordinator, result, resume_timeout, started)
    return result


async def _steps(
    coordinator: Coordinator,
    result: CheckpointNow,
    checkpoint_dir: Any,
    episode_ids: Any,
    deadline_ts: Callable[[], float],
    publish: Callable[[CheckpointNow], Awaitable[Mapping[str, Any] | None]] | None,
    observe: Observer | None,
) -> None:
    checkpoint_id = result.checkpoint_id
    started = time.monotonic()
    result.step = "prepare"
    await _emit(observe, "prepare", checkpoint=checkpoint_id)
    prepared = await coordinator.prepare(checkpoint_id, deadline_ts=deadline_ts())
    result.prepared = prepared
    result.prepare_s = time.monotonic() - started
    if not prepared.ready:
        workers = prepared.worker_blockers()
        named = f"; {', '.join(workers[:10])}" if workers else ""
        result.problem = f"not ready by the deadline ({prepared.blocker_count()} blockers{named})"
        await _emit(observe, "skipped", checkpoint=checkpoint_id, why=result.problem)
        return
    await _emit(observe, "prepared", checkpoint=checkpoint_id)
    result.step = "commit"
    episodes = episode_ids() if callable(episode_ids) else episode_ids
    result.scope = prepared.continued(episodes)
    result.commit_started = time.monotonic()
    directory = await asyncio.to_thread(checkpoint_dir) if callable(checkpoint_dir) else checkpoint_dir
    result.checkpoint_dir = str(directory)
    result.committed = await coordinator.commit(
        checkpoint_id, result.checkpoint_dir, result.scope, deadline_ts=deadline_ts()
    )
    await _emit(observe, "committed", checkpoint=checkpoint_id)
    result.step = "publish"
    extra = (await publish(result)) if publish is not None else None
    result.published = True
    result.step = None
    result.commit_s = time.monotonic() - result.commit_started
    await _emit(observe, "published", checkpoint=checkpoint_id, path=result.checkpoint_dir, **dict(extra or {}))


async def _resume(coordinator: Coordinator, result: CheckpointNow, timeout: float, started: float) -> None:
    """Reopen admission everywhere (participants prepared keep it closed until ``resume``).

    In a task of its own: after a cancellation the caller's task is still cancelling, which the
    HTTP client's own timeouts would read as another cancellation.
    """
    if result.step is not None or result.published:  # the prepare was sent
        try:
            await asyncio.create_task(coordinator.resume(result.checkpoint_id, timeout=timeout))
            result.resumed = True
        except CoordinationError as exc:
            logger.warning("resume of %s failed: %s", result.checkpoint_id, exc)
            result.problem = result.problem or f"resume: {str(exc).splitlines()[0]}"
            result.error = result.error or exc
    result.paused_s = time.monotonic() - started
