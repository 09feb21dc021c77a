"""Gym's training-token capture across a crash: the rows Gym's own rebuild reads hold every call exactly once.

``vllm_model`` (in process, ``return_token_id_information: true``) with 0.7.0's
``token_id_capture`` block on, writing its ``TokenCaptureStore``; the fake backend answers
with chained token ids. A turn has two model calls: the first (a tool call) is answered, the
second's response is held at the model server when the checkpoint is committed. After the
"crash" (a fresh server on the same capture directory, where dead executions left files for
attempts 1 and 2), the restore installs the first call's row under ``r-a1`` and the agent sends
the second call again as attempt 1. ``trajectories_for_rollout`` (Gym's rebuild) then accepts
``r-a1`` with both calls, each once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from control_support import wait_until
from model_support import AUTH, WEATHER_TOOL, ModelServers
from nemo_gym.token_id_capture import TokenCaptureStore, trajectories_for_rollout
from nemo_gym.token_id_capture.records import TokenEntry

CONTROL = "/ng-control/v1/checkpoint"
ROLLOUT = "tc"


@pytest.fixture
async def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ModelServers]:
    capture = {"enabled": True, "dir": str(tmp_path / "captures")}
    servers = ModelServers(tmp_path, monkeypatch, {"token_id_capture": capture})
    await servers.start()
    yield servers
    await servers.aclose()


def capture_path(key: str) -> str:
    return f"/ng-rollout/{key}/training-token-capture/v1/responses"


def first_request(rollout: str) -> dict[str, Any]:
    return {"input": [{"role": "user", "content": f"weather please ({rollout})"}], "tools": [WEATHER_TOOL]}


def second_request(rollout: str, first_output: list[dict[str, Any]]) -> dict[str, Any]:
    body = first_request(rollout)
    call = next(item for item in first_output if item["type"] == "function_call")
    body["input"] += [
        *first_output,
        {"type": "function_call_output", "call_id": call["call_id"], "output": '{"weather": "cold"}'},
    ]
    return body


async def control(http: httpx.AsyncClient, route: str, **body: Any) -> httpx.Response:
    return await http.post(f"{CONTROL}/{route}", json={"deadline_ts": time.time() + 30, **body}, headers=AUTH)


def dead_executions(store: TokenCaptureStore) -> None:
    """What processes of attempts 1 and 2 left before they died: entries, a dangling intent, a frozen state."""
    dead = TokenEntry(
        rollout_id=f"{ROLLOUT}-a1",
        model_call_id="dead-call",
        prompt_token_ids=[1],
        generation_token_ids=[2],
        generation_log_probs=[-0.1],
    )
    store.append(dead)
    store._begin_call(f"{ROLLOUT}-a1", "dangling-call")
    store.freeze_now(f"{ROLLOUT}-a2")  # a frozen attempt 2 would refuse every later write


async def test_restored_capture_holds_every_call_once_and_gym_rebuilds_it(
    servers: ModelServers, tmp_path: Path
) -> None:
    store = TokenCaptureStore(tmp_path / "captures")
    first, http = servers.build(return_token_id_information=True)
    reply = await http.post(capture_path(ROLLOUT), json=first_request(ROLLOUT))
    assert reply.status_code == 200, reply.text
    first_output = reply.json()["output"]
    answered_id = store.read_entries(ROLLOUT)[0].model_call_id

    # The second call generates at the backend while the checkpoint is prepared.
    servers.state.add_rule("weather please", 1, 1)
    pending = asyncio.ensure_future(http.post(capture_path(ROLLOUT), json=second_request(ROLLOUT, first_output)))
    await wait_until(lambda: len(servers.state.held) == 1, timeout=20, what="the second call at the backend")
    assert (await control(http, "prepare", checkpoint_id="ck-1")).json()["phase"] == "prepared"
    servers.state.release(None)
    await wait_until(lambda: first.participant.held == 1, timeout=20, what="its response held")
    assert len(store.read_entries(ROLLOUT)) == 2  # Gym captured the held call before its reply was held
    scope = [{"rollout_id": ROLLOUT, "attempt": 0}, {"rollout_id": "idle", "attempt": 0}]
    committed = await control(
        http, "commit", checkpoint_id="ck-1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=scope
    )
    assert committed.status_code == 200, committed.text
    assert committed.json()["episode_ids"] == [ROLLOUT]
    records = [line for line in (tmp_path / "ck").rglob("records-*.jsonl")][0].read_text().splitlines()
    assert len(records) == 1 and answered_id in records[0]  # the held call's row is not in the checkpoint

    # A server that served calls refuses to restore: its capture files may belong to live episodes.
    await control(http, "resume", checkpoint_id="ck-1")
    await pending
    live = await http.post(capture_path(f"{ROLLOUT}-a1"), json=first_request(ROLLOUT))  # an attempt 1 runs here
    assert live.status_code == 200, live.text
    live_rows = store.read_entries(f"{ROLLOUT}-a1")
    restore = {"checkpoint_dir": str(tmp_path / "ck"), "episode_ids": [{"rollout_id": ROLLOUT, "attempt": 0}]}
    refused = await control(http, "restore", checkpoint_id="restore-0", **restore)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "invalid_phase", refused.text
    assert store.read_entries(f"{ROLLOUT}-a1") == live_rows  # the refusal touched no live capture

    # The crash: a fresh process on the same capture directory, after dead executions of attempts 1 and 2.
    dead_executions(store)
    fresh, http2 = servers.build(return_token_id_information=True)
    restored = await control(http2, "restore", checkpoint_id="restore-1", **restore)
    assert restored.status_code == 200, restored.text
    assert restored.json()["restored"] == [f"{ROLLOUT}-a1"]
    assert [e.model_call_id for e in store.read_entries(f"{ROLLOUT}-a1")] == [answered_id]
    assert store.read_entries(f"{ROLLOUT}-a1")[0].rollout_id == ROLLOUT  # keeps the key it was recorded under
    assert not store.state_path_for(f"{ROLLOUT}-a2").exists()
    await control(http2, "resume", checkpoint_id="restore-1")

    # The agent sends the call that was held again, as attempt 1.
    again = await http2.post(capture_path(f"{ROLLOUT}-a1"), json=second_request(ROLLOUT, first_output))
    assert again.status_code == 200, again.text
    built = trajectories_for_rollout(f"{ROLLOUT}-a1", [tmp_path / "captures"])
    assert built is not None and built["mask_sample"] is False, built
    assert built["metrics"]["n_calls"] == 2 and not built["metrics"].get("capture_incomplete")
    ids = [e.model_call_id for e in store.read_entries(f"{ROLLOUT}-a1")]
    assert len(ids) == len(set(ids)) == 2 and ids[0] == answered_id


async def test_delete_restored_leaves_nothing_that_refuses_the_attempt(servers: ModelServers, tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path / "captures")
    first, http = servers.build(return_token_id_information=True)
    for rollout in ("kept", "dropped"):
        assert (await http.post(capture_path(rollout), json=first_request(rollout))).status_code == 200
    assert (await control(http, "prepare", checkpoint_id="ck-1")).json()["phase"] == "prepared"
    scope = [{"rollout_id": r, "attempt": 0} for r in ("kept", "dropped")]
    ck = str(tmp_path / "ck")
    assert (await control(http, "commit", checkpoint_id="ck-1", checkpoint_dir=ck, episode_ids=scope)).is_success

    fresh, http2 = servers.build(return_token_id_information=True)
    restored = await control(http2, "restore", checkpoint_id="restore-1", checkpoint_dir=ck, episode_ids=scope)
    assert restored.json()["restored"] == ["dropped-a1", "kept-a1"], restored.text
    assert sorted(fresh.participant.restored_pending()) == ["dropped-a1", "kept-a1"]
    await control(http2, "resume", checkpoint_id="restore-1")
    # A later checkpoint that continues only "kept": the restored "dropped-a1", never started, is deleted.
    assert (await control(http2, "prepare", checkpoint_id="ck-2")).json()["phase"] == "prepared"
    later = [{"rollout_id": "kept", "attempt": 1}]
    ck2 = str(tmp_path / "ck2")
    assert (await control(http2, "commit", checkpoint_id="ck-2", checkpoint_dir=ck2, episode_ids=later)).is_success
    await wait_until(lambda: not store.path_for("dropped-a1").exists(), what="the dropped attempt deleted")
    await control(http2, "resume", checkpoint_id="ck-2")
    # Nothing refuses the attempt: it starts over from its input and Gym rebuilds just that.
    assert (await http2.post(capture_path("dropped-a1"), json=first_request("dropped"))).status_code == 200
    built = trajectories_for_rollout("dropped-a1", [tmp_path / "captures"])
    assert built is not None and built["mask_sample"] is False and built["metrics"]["n_calls"] == 1
