"""A commit or restore through the coordination library holds a lease: gc never removes that checkpoint meanwhile.

Real participant servers (``coord_support``) that never answer the commit or the restore, so the
operation is under way while the test runs ``gc --yes``; on a local root and an S3 prefix alike.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson
import pytest
from coord_support import TOKEN, start_participants, stop_participants

from nemo_gym_checkpoint_plugin._storage.index import write_participants_index
from nemo_gym_checkpoint_plugin._storage.location import location, names
from nemo_gym_checkpoint_plugin._storage.retention import LEASE_DIR, plan_retention
from nemo_gym_checkpoint_plugin.cli import main
from nemo_gym_checkpoint_plugin.coordination import CoordinationError, discover
from nemo_gym_checkpoint_plugin.coordination._collector_state import CheckpointStore, CollectorState, RowState

pytestmark = pytest.mark.slow


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(tmp_path / "ckpt") if request.param == "local" else request.getfixturevalue("s3_dir")


def published(store: CheckpointStore, seq: int) -> str:
    checkpoint_id = store.checkpoint_id(seq)
    write_participants_index(store.path(checkpoint_id), checkpoint_id, [])
    state = CollectorState(checkpoint_id, {"participants": [], "output": "/x"}, [RowState("0-0", 0, "continued")])
    store.publish(state, *store.write_records(state))
    return checkpoint_id


async def wait_for(predicate, timeout: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, "timed out waiting for the lease"
        await asyncio.sleep(0.05)  # wait-ok: poll interval of a bounded wait on a condition


@pytest.mark.parametrize("operation", ["restore", "commit"])
async def test_gc_keeps_a_checkpoint_a_restore_or_commit_is_using(
    root: str, tmp_path: Path, operation: str, capsys: pytest.CaptureFixture
) -> None:
    store = CheckpointStore(root)
    ids = [published(store, seq) for seq in (1, 2, 3)]
    # The oldest one is used: restored from, or (a retried commit) committed into again.
    target = str(store.path(ids[0]))
    servers = start_participants(tmp_path, [{"kind": "model", "instance": "policy_model", "hang": [operation]}])
    try:
        async with await discover([s.url for s in servers], TOKEN) as coordinator:
            if operation == "restore":
                call = coordinator.restore("restore-old", target, [{"rollout_id": "0-0", "attempt": 0}], timeout=4)
            else:
                call = coordinator.commit(ids[0], target, None, timeout=4)
            task = asyncio.ensure_future(call)
            await wait_for(lambda: names(location(target) / LEASE_DIR) != [])
            assert [c.name for c in plan_retention(root, 1).in_use] == [ids[0]]
            status = await asyncio.to_thread(main, ["gc", "--json", root, "--keep", "1", "--yes"])
            done = orjson.loads(capsys.readouterr().out)
            assert status == 0 and done["removed"] == [ids[1]]
            (row,) = [r for r in done["checkpoints"] if r["name"] == ids[0]]
            assert row["why"].startswith(f"in use: {operation} of ")
            with pytest.raises(CoordinationError):
                await task  # the participant never answers: the operation fails at its deadline
        # The lease went with the operation: the next gc removes the old checkpoint.
        assert names(location(target) / LEASE_DIR) == []
        assert [c.name for c in plan_retention(root, 1).remove] == [ids[0]]
    finally:
        stop_participants(servers)
