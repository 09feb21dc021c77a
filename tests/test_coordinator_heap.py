"""The coordinator's fan-out holds its own process's heap frozen (no full collection of a training
controller's heap while it waits for the replies) and thaws it after, whatever the outcome."""

from __future__ import annotations

import gc

import pytest
from coord_support import FOUR, TOKEN, config_for, start_participants, stop_participants

from nemo_gym_checkpoint_plugin.coordination import CoordinationError, commit, discover, prepare, resume

pytestmark = pytest.mark.slow


@pytest.fixture
def four(tmp_path):
    servers = start_participants(tmp_path, [dict(spec, holds=["r1"]) for spec in FOUR])
    yield servers
    stop_participants(servers)


async def test_every_reply_is_read_with_the_heap_frozen_and_it_is_thawed_after(four, tmp_path, monkeypatch):
    monkeypatch.setenv("COORD_TEST_TOKEN", TOKEN)
    assert gc.get_freeze_count() == 0
    frozen_at_reply: list[tuple[str, bool]] = []
    async with await discover(config_for(four)) as coordinator:
        coordinator.progress = lambda p: frozen_at_reply.append((p.operation, gc.get_freeze_count() > 0))
        await prepare(coordinator, "c1", timeout=30)
        assert gc.get_freeze_count() == 0
        await commit(coordinator, "c1", str(tmp_path / "ckpt"), [{"rollout_id": "r1", "attempt": 0}], timeout=30)
        assert gc.get_freeze_count() == 0
        with pytest.raises(CoordinationError):  # a failed operation thaws it too
            await commit(coordinator, "c2", str(tmp_path / "ckpt2"), None, timeout=30)
        assert gc.get_freeze_count() == 0
        await resume(coordinator, "c1", timeout=30)
    operations = {operation for operation, _ in frozen_at_reply}
    assert {"prepare", "commit", "resume"} <= operations
    assert len(frozen_at_reply) >= 4 * 4 and all(frozen for _, frozen in frozen_at_reply)
    assert gc.get_freeze_count() == 0
