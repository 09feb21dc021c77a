"""``coordination.checkpoint_now``: one checkpoint at once within a budget (a preemption notice), real servers.

The participants are the coordination tests' real uvicorn processes (``coord_support``: the plugin's
control plane and routes with a small stub participant). A checkpoint within its budget is published
and the deployment resumed; one whose commit a participant never answers ends at the budget (not
the commit's own deadline plus its reply grace), publishes nothing, and still resumes every
participant; ``collect``'s checkpoint (``CollectionCheckpointer.checkpoint(budget=...)``, what a
SIGTERM runs) is the same call and writes no manifest then.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from coord_support import FOUR, TOKEN, start_participants, stop_participants

from nemo_gym_checkpoint_plugin.coordination import checkpoint_now, discover
from nemo_gym_checkpoint_plugin.coordination._checkpointer import CollectionCheckpointer
from nemo_gym_checkpoint_plugin.coordination._collection import RunTracker
from nemo_gym_checkpoint_plugin.coordination._collector_state import CheckpointStore

pytestmark = pytest.mark.slow

HOLDS = ["r1", "r2-a1"]
BUDGET = 1.5


async def test_checkpoint_now_prepares_commits_publishes_and_resumes_within_its_budget(tmp_path: Path) -> None:
    servers = start_participants(tmp_path, [dict(spec, holds=HOLDS) for spec in FOUR])
    target = tmp_path / "step-7"
    events: list[str] = []
    try:
        async with await discover([s.url for s in servers], TOKEN) as coordinator:
            started = time.monotonic()
            now = await checkpoint_now(
                coordinator,
                "step-7",
                str(target),
                ["r1", {"rollout_id": "r2", "attempt": 1}],
                budget=10,
                observe=lambda event, _data: events.append(event),
            )
            assert time.monotonic() - started < 10
            statuses, _ = await coordinator.status()
        assert now.published and now.resumed and now.problem is None and not now.out_of_time
        assert now.scope == [{"rollout_id": "r1", "attempt": 0}, {"rollout_id": "r2", "attempt": 1}]
        assert events == ["prepare", "prepared", "committed", "published"]
        assert (target / "gym" / "participants.json").exists()  # the commit's last write: published
        assert {s["phase"] for s in statuses.values()} == {"idle"}
        for server in servers:
            assert [op for op in server.ops() if op != "status"] == ["prepare", "commit", "resume"], server.name
    finally:
        stop_participants(servers)


async def test_at_the_budgets_end_nothing_is_published_and_every_participant_is_resumed(tmp_path: Path) -> None:
    specs = [dict(spec, holds=HOLDS) for spec in FOUR]
    specs[2]["hang"] = ["commit"]  # the agent never answers its commit
    servers = start_participants(tmp_path, specs)
    try:
        # reply_grace 10 s: the commit alone would wait its deadline plus that; the budget ends it first.
        async with await discover([s.url for s in servers], TOKEN, reply_grace=10.0) as coordinator:
            started = time.monotonic()
            now = await checkpoint_now(coordinator, "step-8", str(tmp_path / "step-8"), HOLDS, budget=BUDGET)
            elapsed = time.monotonic() - started
            assert not now.published and now.out_of_time and now.resumed
            assert now.problem == f"the budget of {BUDGET:g}s ended during the commit; nothing was published"
            assert elapsed < BUDGET + 2.0, f"{elapsed:.2f}s for a budget of {BUDGET}s"
            assert not (tmp_path / "step-8" / "gym" / "participants.json").exists()

            # collect's checkpoint (the one a SIGTERM takes) is the same call: no collector manifest either.
            tracker = RunTracker()
            tracker.started("r1", 0)
            tracker.started("r2", 1)
            store = CheckpointStore(tmp_path / "ckpt")
            (tmp_path / "ckpt").mkdir()
            checkpointer = CollectionCheckpointer(
                coordinator, store, tracker, every=60, keep=2, deployment={}, output_path=tmp_path / "out.jsonl"
            )
            started = time.monotonic()
            record = await checkpointer.checkpoint(budget=BUDGET)
            elapsed = time.monotonic() - started
            statuses, _ = await coordinator.status()
        assert not record.published and record.problem is not None and "ended during the commit" in record.problem
        assert elapsed < BUDGET + 2.0, f"{elapsed:.2f}s for a budget of {BUDGET}s"
        assert store.published() == [] and checkpointer.last_published_at is None
        assert {s["phase"] for s in statuses.values()} == {"idle"}
        for server in servers:
            assert server.ops().count("resume") == 2, server.name  # after each cut-short commit
    finally:
        stop_participants(servers)
