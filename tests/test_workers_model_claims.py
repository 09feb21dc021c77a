"""A model server with several workers and token capture: what a worker's claim of a replacement installs.

On a server with several workers a restore installs nothing in any worker; the worker that receives a
replacement's first call claims its records then (docs/protocol.md, "Several workers"), after the
restore resumed, while it serves other episodes' calls. For the model participant that install must

- not be refused because the worker has served calls (the coordinator refused the restore itself if
  any worker had served one before it);
- clear what dead executions left for *that* replacement, whatever other claims cleared before it
  (there is no once-per-restore clearing to rely on), and remove the attempt it continues;
- and a later call of the replacement on another worker goes on: the rows are in the capture
  directory every worker shares, so that worker's claim refused ``attempt_running`` is no refusal.

The capture directory is Gym's own store; the install is the model participant's hook, called through
the worker's facade as ``Worker.claim`` calls it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from nemo_gym.token_id_capture import TokenCaptureStore
from nemo_gym.token_id_capture.records import TokenEntry
from nemo_gym_checkpoint_plugin.builtin_participants.model.calls import ModelCalls
from nemo_gym_checkpoint_plugin.builtin_participants.model.token_capture import TokenCaptures

from nemo_gym_checkpoint_plugin._control.facade import Participants
from nemo_gym_checkpoint_plugin._errors import AttemptRunning, InvalidPhase
from nemo_gym_checkpoint_plugin._identity import episode_id
from nemo_gym_checkpoint_plugin._plugins import make_plugin_manager
from nemo_gym_checkpoint_plugin._types import RestoredRecord
from nemo_gym_checkpoint_plugin._workers.attach import ClaimRestored

ROLLOUTS = ("one", "two")


def _entry(key: str, call_id: str) -> TokenEntry:
    return TokenEntry(
        rollout_id=key,
        model_call_id=call_id,
        prompt_token_ids=[1, 2],
        generation_token_ids=[3],
        generation_log_probs=[-0.5],
    )


def _ids(store: TokenCaptureStore, key: str) -> list[str]:
    return [entry.model_call_id for entry in store.read_entries(key)]


async def test_claims_install_each_replacement_while_the_worker_serves_and_clear_each_dead_execution(
    tmp_path: Path,
) -> None:
    store = TokenCaptureStore(tmp_path / "captures")
    for rollout in ROLLOUTS:
        store.append(_entry(rollout, f"{rollout}-answered"))  # attempt 0, as the crashed run captured it
        store.append(_entry(f"{rollout}-a1", f"{rollout}-dead"))  # what a dead execution of attempt 1 left
    captures = TokenCaptures(store)
    owned = {rollout: {f"{rollout}-answered"} for rollout in ROLLOUTS}
    records = {record["episode_id"]["rollout_id"]: record for record in captures.export(list(ROLLOUTS), owned)}

    calls = ModelCalls(captures=captures)
    participants = Participants(make_plugin_manager([calls], load_entry_points=False))
    calls.served_total = 7  # the worker served other episodes since the restore resumed
    for rollout in ROLLOUTS:
        replacement = episode_id(rollout, 1)
        restored = RestoredRecord(episode_id(rollout, 0), replacement, records[rollout])
        await participants.install("rs", {}, [restored], [replacement], claimed=True)
        # Exactly the answered call under the replacement: the dead execution's row is gone, for each claim.
        assert _ids(store, f"{rollout}-a1") == [f"{rollout}-answered"], rollout
        # Its rows live on under the replacement: attempt 0 is gone (no restore's end comes after a claim).
        assert not store.path_for(rollout).exists(), rollout
    assert calls.restored_pending() == ["one-a1", "two-a1"]
    assert not [name for name in os.listdir(tmp_path / "captures") if name.startswith(".ng-checkpoint-restore-")]

    # A restore (not a claim) into a model server that served calls is still refused.
    again = RestoredRecord(episode_id("one", 1), episode_id("one", 2), records["one"])
    with pytest.raises(InvalidPhase, match="served 7 model calls"):
        await participants.install("rs2", {}, [again], [episode_id("one", 2)])


class _ClaimedElsewhere:
    """A worker whose coordinator says another worker claimed the replacement."""

    def __init__(self) -> None:
        self.restorable = {"one-a1"}
        self.claims = 0

    async def claim(self, episode: Any) -> bool:
        self.claims += 1
        raise AttemptRunning("the restored record of one-a1 was claimed by worker 2", episodes=["one-a1"])


async def _call(shared: bool) -> tuple[int, _ClaimedElsewhere, int]:
    worker = _ClaimedElsewhere()
    served = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal served
        served += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    middleware = ClaimRestored(app, worker=worker, run_path=None, shared=shared)  # type: ignore[arg-type]
    statuses: list[int] = []

    async def send(message: Any) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/ng-rollout/one-a1/v1/responses"}
    for _ in range(2):
        await middleware(scope, receive, send)
    assert len(set(statuses)) == 1
    return statuses[0], worker, served


async def test_a_model_call_whose_replacement_another_worker_claimed_goes_on() -> None:
    status, worker, served = await _call(shared=True)
    assert status == 200 and served == 2
    assert worker.claims == 1 and worker.restorable == set()  # asked once: the rows are in the shared directory
    # Elsewhere (an environment's /run, a record living in one request) it stays refused.
    status, worker, served = await _call(shared=False)
    assert status == 409 and served == 0 and worker.claims == 2
