"""The plugin beyond the contract: a tally continues after a restore, and verify is declared replayable."""

from __future__ import annotations

from typing import Any

from tally_verifier.app import TallyResourcesServer

from nemo_gym_checkpoint_plugin.api import RestoredRecord, make_episode_id

# As a deployment's YAML declares it: the state is exported by a plugin (this package's).
BLOCK = {"checkpoint_mode": "export_restore"}

SEED = {
    "resources_session_id": "res-1",
    "episode_id": {"rollout_id": "t-1", "attempt": 0},
    "task_id": {"taskset": "tally", "task_id": "t-1"},
    "task_data": {"target": 5},
}
VERIFY = {
    "responses_create_params": {"input": [{"role": "user", "content": "add"}]},
    "response": {
        "id": "r",
        "created_at": 0.0,
        "model": "m",
        "object": "response",
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "output": [],
    },
}


async def test_a_restored_tally_continues_where_it_was(participant_servers: Any) -> None:
    first = participant_servers(TallyResourcesServer, name="tally", block=BLOCK)
    async with first.client() as http:
        seeded = await http.post("/seed_session", json=SEED)
        assert seeded.headers.get("x-ng-checkpoint-verify") == "replay"
        assert (await http.post("/add", json={"amount": 3})).json() == {"total": 3}
        cookies = http.cookies
    [record] = first.plugin("tally_verifier").export(checkpoint_id="ck", scope=frozenset({"t-1"})).records

    second = participant_servers(TallyResourcesServer, name="tally", block=BLOCK)  # the process after a crash
    checkpointed = make_episode_id("t-1", 0)
    second.plugin("tally_verifier").install(
        records=[RestoredRecord(checkpointed=checkpointed, replacement=make_episode_id("t-1", 1), record=record)],
        scope=[make_episode_id("t-1", 1)],
    )
    async with second.client(cookies) as http:
        assert (await http.post("/add", json={"amount": 2})).json() == {"total": 5}
        verified = await http.post("/verify", json=VERIFY)
    assert verified.json()["reward"] == 1.0
    assert (await second.status())["tally_sessions"] == 1
