"""``ng-checkpoint collect``: Gym's own rollout collection, checkpointed while rows are in flight.

The configuration is exactly ``ng_collect_rollouts``' (Gym's ``+key=value`` overrides:
``+config_paths=[...]``, ``+input_jsonl_fpath=...``, ``+output_jsonl_fpath=...``, ...), read by
Gym's own parser; the collection runs in Gym's ``RolloutCollectionHelper`` (subclassed, see
``coordination._collection``). Added: ``--checkpoint-every``, ``--checkpoint-dir`` (absolute, or an
object-store URL such as ``s3://bucket/run``: the deployment's ``checkpoint.storage.backend`` is then ``fsspec``),
``--keep``, ``--resume`` (Gym's ``resume_from_cache`` plus a restore of the last published
checkpoint that verifies; a damaged one falls back to the one before, and says so), ``--drain-budget``
(a SIGTERM takes one last checkpoint at once within it, then the collection stops: ``_collect_drain.py``).
The arguments are in ``_collect_args.py``.

Everything that can be refused is refused before any row or server is touched: a relative
``--checkpoint-dir``, one whose parent is missing or that cannot be written, one another user could
change (``_collect_root.py``; ``--allow-shared-root`` to use it with a warning), one another collector
holds (``collect.lock``, see ``coordination._collect_lock``), one holding checkpoints of an
earlier collection (without ``--resume``) or of another deployment. Once the collector owns the
deployment, retired marks it did not make (a restore by hand) are refused, exit 2, naming the
rollouts and the ``forget`` command (``_collect_marks.py``).

The summary is read from Gym's files at the end (``_collect_tally.py``): ``finished`` counts the
rows in the output, terminal failures are listed as such, and a row missing from the output or
in it twice is an error naming the rows.
Exit status: 0 done (every row once in the output or failed for good), or stopped on SIGTERM with a
last checkpoint published; 1 the collection or the deployment failed, a row is missing or duplicated at
the end, or a SIGTERM stopped it without a last checkpoint; 2 usage or leftover retired marks.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from .._errors import InvalidCheckpointState
from .._identity import capture_key
from .._storage.objstore import ObjectPath, is_url
from .._storage.objstore_put import check_exclusive_create
from ..coordination._collect_lock import CollectionLock, DirectoryLocked, collector_owner
from ..coordination._collector_state import CheckpointStore, deployment_identity, identity_mismatch
from ..coordination._errors import CoordinationError
from ._collect_args import add_collect_parser
from ._collect_drain import Drain
from ._collect_marks import leftover_marks, marks_refusal, token_arguments
from ._collect_owner import OwnerKeeper, give_back, resume_left_open, take_deployment
from ._collect_progress import CollectProgress, collect_summary, lost_work_line, pause_warning, summary_table
from ._collect_root import untrusted
from ._collect_tally import finished_rollouts, tally
from ._output import print_json
from ._where import UsageError, _token

__all__ = ["add_collect_parser", "check_checkpoint_dir", "run_collect"]


def check_checkpoint_dir(raw: str) -> Path | ObjectPath:
    """The checkpoint directory, or ``UsageError`` saying why it cannot be one (nothing is created).

    A URL must name a store that refuses a second exclusive create (probed now, before any row
    or server is touched); its credentials come from the store's own environment and config.
    """
    if is_url(raw):
        try:
            where = ObjectPath(raw)
            check_exclusive_create(where)
        except ValueError as exc:
            raise UsageError(f"--checkpoint-dir: {exc}") from None
        except InvalidCheckpointState as exc:
            raise UsageError(f"--checkpoint-dir {where}: {exc.detail}") from None
        return where
    path = Path(raw)
    if not path.is_absolute():
        raise UsageError(
            f"--checkpoint-dir {raw} is relative; give an absolute path (every server writes "
            "into it, from its own working directory)"
        )
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"--checkpoint-dir {raw} exists and is not a directory")
        probe = path
    else:
        if not path.parent.is_dir():
            raise UsageError(f"--checkpoint-dir {raw}: its parent {path.parent} does not exist")
        probe = path.parent
    # A real write, not os.access: root passes every permission check, a read-only filesystem does not.
    trial = probe / f".ng-checkpoint-probe-{uuid.uuid4().hex}"
    try:
        os.close(os.open(trial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(trial)
    except OSError as exc:
        raise UsageError(f"--checkpoint-dir {raw}: {probe} is not writable ({exc.strerror or exc})") from None
    return path


def _gym_config(overrides: list[str], resume: bool) -> tuple[Any, Any]:
    """Gym's global config and ``RolloutCollectionConfig``, parsed as ``ng_collect_rollouts`` parses them."""
    from nemo_gym.global_config import get_global_config_dict
    from nemo_gym.rollout_collection import RolloutCollectionConfig

    saved = sys.argv
    sys.argv = [saved[0], *overrides]
    try:
        config = get_global_config_dict()
        collection = RolloutCollectionConfig.model_validate(config)
    except Exception as exc:  # Gym raises its config errors, pydantic's and omegaconf's
        raise UsageError(f"the collection's configuration: {str(exc).strip().splitlines()[0]}") from None
    finally:
        sys.argv = saved
    if resume:
        collection.resume_from_cache = True
    return config, collection


def run_collect(args: argparse.Namespace, observe: Callable[[str, dict[str, Any]], Any] | None = None) -> int:
    """The ``collect`` command; ``observe`` also receives every checkpointer event (tests hook there)."""
    root = check_checkpoint_dir(args.checkpoint_dir)
    notes: list[str] = []
    if isinstance(root, ObjectPath):
        # No flock and no file owner on an object store: the owner lease alone keeps one controller per deployment.
        notes.append(
            f"{root} is an object store: no directory lock there (one collection per checkpoint "
            "directory is not enforced); the deployment's owner lease still refuses a second controller"
        )
    else:
        _trusted(root, args.allow_shared_root, notes.append)
    overrides = [o for o in args.gym_overrides if o != "--"]
    config, collection = _gym_config(overrides, args.resume)
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(config, resolve=False)
    if not isinstance(container, dict):  # OmegaConf's signature covers list configs; Gym's is a mapping
        raise UsageError("the Gym config is not a mapping")
    # Gym's config keys are server and setting names (str); OmegaConf types a dict's keys more widely.
    plain = cast(dict[str, Any], container)
    token, _source, _argv = _token(args, plain)
    output = str(Path(collection.output_jsonl_fpath).resolve())
    store = CheckpointStore(root, collection=output)
    if isinstance(root, ObjectPath):
        if not args.resume and store.published():
            raise UsageError(
                f"--checkpoint-dir {root} holds checkpoints of an earlier collection; pass --resume "
                "to continue it, or choose another directory"
            )
        return asyncio.run(_collect(args, root, store, plain, token, collection, observe, notes, None))
    lock = _lock(root, store, output)
    # Again once it exists: another user may have made it first, where the parent let them.
    _trusted(root, args.allow_shared_root, lambda _warning: None)
    try:
        previous = lock.acquire()
    except DirectoryLocked as exc:
        raise UsageError(
            f"--checkpoint-dir {root} is in use: {exc}; one collection per checkpoint directory "
            "(wait for it to end, or choose another directory)"
        ) from None
    except OSError as exc:
        raise UsageError(f"--checkpoint-dir {root}: cannot take its lock {lock.path} ({exc.strerror or exc})") from None
    try:
        if previous is not None:
            # A dead collector's lock: its unpublished attempts are this collection's to remove too.
            store.runs.add(previous.run)
            notes.append(f"took over {lock.path} from a {previous.describe()}, which is gone")
        if not args.resume and store.published():
            raise UsageError(
                f"--checkpoint-dir {root} holds checkpoints of an earlier collection; pass --resume "
                "to continue it, or choose another directory"
            )
        predecessor = previous.owner if previous is not None else None
        return asyncio.run(_collect(args, root, store, plain, token, collection, observe, notes, predecessor))
    finally:
        lock.release()


def _trusted(root: Path, allowed: bool, warn: Callable[[str], None]) -> None:
    """Refuse (``UsageError``) a root another user could change, or ``warn`` with --allow-shared-root."""
    problem = untrusted(root)
    if problem is None:
        return
    if not allowed:
        raise UsageError(
            f"--checkpoint-dir {root} is not safe: {problem}; another user could redirect the next "
            "checkpoint or plant a forged one there. Choose a directory only you can write, or pass "
            "--allow-shared-root to use it anyway"
        )
    warn(
        f"warning: --checkpoint-dir {root} is shared ({problem}); going on (--allow-shared-root): "
        "checkpoint directories are created exclusively, never through a link, and only checkpoints this "
        "user wrote are resumed"
    )


def _lock(root: Path, store: CheckpointStore, output: str) -> CollectionLock:
    """The directory's lock for this collector (the directory made first, ``0700``, when it is missing)."""
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UsageError(f"--checkpoint-dir {root} cannot be created ({exc.strerror or exc})") from None
    return CollectionLock(root, collector_owner(store.run), store.run, output)


async def _collect(
    args: argparse.Namespace,
    root: Path | ObjectPath,
    store: CheckpointStore,
    plain: dict[str, Any],
    token: str,
    collection: Any,
    observe: Callable[[str, dict[str, Any]], Any] | None,
    notes: list[str],
    predecessor: str | None,
) -> int:
    from ..coordination import discover
    from ..coordination._checkpointer import CollectionCheckpointer, RestorePlan
    from ..coordination._collection import CheckpointingCollectionHelper

    progress = CollectProgress()
    for note in notes:
        progress.say(note)
    try:
        coordinator = await discover(plain, token, probe_timeout=args.probe_timeout, tries=args.tries)
    except CoordinationError as exc:
        print(f"ng-checkpoint collect: error: {exc}", file=sys.stderr)
        return 1
    async with coordinator:
        identity = deployment_identity(
            coordinator.participants, collection.output_jsonl_fpath, getattr(collection, "input_jsonl_fpath", None)
        )
        state, fallbacks = store.latest() if args.resume else (None, [])
        if state is not None and (why := identity_mismatch(state.deployment, identity)):
            raise UsageError(f"--checkpoint-dir {root} holds checkpoints of another deployment: {why}")
        owner = collector_owner(store.run)
        try:
            # One controller per deployment, before anything is restored or dispatched (_collect_owner.py).
            await take_deployment(
                coordinator,
                owner,
                take_over=args.take_over,
                predecessor=predecessor,
                say=progress.say,
                timeout=args.checkpoint_timeout,
            )
            # A dead collector's checkpoint still open on live servers would park every row until its lease ends.
            await resume_left_open(coordinator, progress.say, args.checkpoint_timeout)
            # Marks this collection did not make would refuse its rows: refused before anything is marked.
            finished = finished_rollouts(Path(collection.output_jsonl_fpath)) if state is not None else set()
            next_attempts = {row.rollout_id: row.attempt + 1 for row in state.rows} if state is not None else {}
            leftovers = await leftover_marks(
                coordinator, args.checkpoint_timeout, resume=args.resume, next_attempts=next_attempts, finished=finished
            )
        except CoordinationError as exc:
            print(f"ng-checkpoint collect: error: {exc}", file=sys.stderr)
            await give_back(coordinator, args.checkpoint_timeout)
            return 1
        if leftovers:
            urls = [participant.url for participant in coordinator.participants]
            print(
                f"ng-checkpoint collect: error: {marks_refusal(leftovers, urls, token_arguments(args))}",
                file=sys.stderr,
            )
            await give_back(coordinator, args.checkpoint_timeout)
            return 2
        for checkpoint_id, why in fallbacks:
            progress.say(f"checkpoint {checkpoint_id} does not verify ({why}); falling back to the one before")
        helper = CheckpointingCollectionHelper()
        tracker = helper.tracker
        pause_warnings: list[str] = []

        async def observed(event: str, data: dict[str, Any]) -> None:
            if event == "resumed":
                progress.checkpoint_line(data["record"])
                warning = pause_warning(data["record"], args.checkpoint_every, args.max_pause_share)
                if warning is not None:
                    pause_warnings.append(warning)
                    progress.say(f"warning: {warning}")
            if observe is not None:
                outcome = observe(event, data)
                if asyncio.iscoroutine(outcome):
                    await outcome

        checkpointer = CollectionCheckpointer(
            coordinator,
            store,
            tracker,
            every=args.checkpoint_every,
            keep=args.keep,
            deployment=identity,
            output_path=collection.output_jsonl_fpath,
            timeout=args.checkpoint_timeout,
            observe=observed,
        )
        plan = RestorePlan()
        if state is not None:
            try:
                plan = await checkpointer.restore_from(state, finished)
            except CoordinationError as exc:
                # Nothing dispatched yet: a rerun of --resume retires and restores again.
                print(f"ng-checkpoint collect: error: resuming from {state.checkpoint_id}: {exc}", file=sys.stderr)
                await give_back(coordinator, args.checkpoint_timeout)
                return 1
            helper.set_attempts(
                plan.attempts,
                restored=[capture_key(rollout_id, plan.attempts[rollout_id]) for rollout_id in plan.continued],
            )
            if plan.lost_work is not None:
                progress.say(lost_work_line(plan.lost_work.to_json()))
            progress.say(
                f"restored {len(plan.continued)} rows from {state.checkpoint_id} in {plan.restore_s:.2f}s; "
                f"{len(plan.restarted)} start over"
                + (f" (restore failed: {plan.problem})" if plan.problem else "")
                + (
                    f"; {len(plan.retired)} restarts and uncaptured rows retired everywhere, sent as their next attempt"
                    if plan.retired
                    else ""
                )
            )
        elif args.resume:
            progress.say("no published checkpoint to restore; Gym's resume_from_cache alone")
        plan.fallbacks = fallbacks

        def changed() -> None:
            progress.update(
                total=helper.total, done=helper.done_before + tracker.returned, in_flight=len(tracker.in_flight)
            )

        tracker.on_change = changed
        if progress.live:
            os.environ.setdefault("TQDM_DISABLE", "1")  # one progress display on the terminal, not two
        progress.start()
        loop_task = asyncio.create_task(checkpointer.run())
        run_task = asyncio.create_task(helper.run_from_config(collection))
        # Taken over by another controller: this one stops at once, it never fights for the deployment.
        keeper = OwnerKeeper(
            coordinator,
            owner,
            args.checkpoint_every,
            args.checkpoint_timeout,
            on_fenced=lambda _detail: run_task.cancel(),
        )
        keeper_task = asyncio.create_task(keeper.run())
        # SIGTERM: one last checkpoint within --drain-budget, then Gym's collection stops (_collect_drain.py).
        drain = Drain(checkpointer, args.drain_budget, progress.say, stop=run_task.cancel)
        drain.install()
        started = time.monotonic()
        failed: BaseException | str | None = None
        try:
            await run_task
        except asyncio.CancelledError:
            if keeper.fenced is None and not drain.draining:
                raise
            if keeper.fenced is not None:
                failed = f"another controller took the deployment over ({keeper.fenced}); this collector stopped"
        except Exception as exc:  # Gym's own failure of the run: reported, exit 1
            failed = exc
        finally:
            drain.remove()
            await drain.wait()
            keeper.stop()
            checkpointer.stop()
            await loop_task
            await keeper_task
            progress.stop()
        if keeper.fenced is None:
            await give_back(coordinator, args.checkpoint_timeout)
        # What the files hold, not what this process saw: a second controller's rows, a row written
        # twice, a row whose attempt lived elsewhere all show here (_collect_tally.py).
        outcome = tally(collection)
        summary = collect_summary(root, helper, checkpointer, plan, outcome, time.monotonic() - started, drain)
        summary["pause_warnings"] = pause_warnings
        print(summary_table(summary), file=sys.stderr)
        if outcome.terminal:
            progress.say(
                f"{len(outcome.terminal)} rows failed for good (Gym's failures sidecar, never retried): "
                f"{', '.join(outcome.terminal[:20])}{' ...' if len(outcome.terminal) > 20 else ''}"
            )
        problems = outcome.problems(missing=not drain.published)
        if drain.draining:
            last: list[str | None] = [c.checkpoint_id for c in checkpointer.checkpoints if c.published] or [plan.source]
            lines, errors = drain.report(outcome.missing_line(), last[-1])
            for line in lines:
                progress.say(line)
            problems += errors
        if failed is not None:
            problems.insert(0, f"the collection failed: {failed}")
        for problem in problems:
            print(f"ng-checkpoint collect: error: {problem}", file=sys.stderr)
        if getattr(args, "json", False):
            print_json(summary, compact=True)
        return 1 if problems else 0
