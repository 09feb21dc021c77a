"""A continued cut with Gym's token capture on: one capture row for the whole call, the capture invariant kept.

``vllm_model`` in process with 0.7.0's ``token_id_capture`` (its file store) and generation cuts.
A turn's first call (a tool call) is answered; its second (a long answer) is generating when the
checkpoint is committed: one record holds the first call's row and the second's cut. After the
"crash" the restore installs the row under ``r-a1``, the re-sent call continues the cut, and Gym
writes one row for it, prefix and remainder: ``trajectories_for_rollout`` accepts ``r-a1`` with
both calls, each once, the second's tokens those of an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from cut_support import CutServers, control, first_request
from nemo_gym.token_id_capture import TokenCaptureStore, trajectories_for_rollout

ROLLOUT = "tk"
WORDS = 200


@pytest.fixture
async def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[CutServers]:
    capture = {"enabled": True, "dir": str(tmp_path / "captures")}
    servers = CutServers(
        tmp_path, monkeypatch, cuts={"tool_call_parser": "hermes"}, extra_config={"token_id_capture": capture}
    )
    await servers.start()
    yield servers
    await servers.aclose()


def path_of(key: str) -> str:
    # Gym's capture records the calls of this route (the agent's token-capturing client calls it).
    return f"/ng-rollout/{key}/training-token-capture/v1/responses"


def conversation(name: str) -> str:
    return f"capture me ({name}) [answer_words={WORDS}]"


def second_request(name: str, first_output: list[dict[str, Any]]) -> dict[str, Any]:
    body = first_request(conversation(name))
    call = next(item for item in first_output if item["type"] == "function_call")
    body["input"] += [
        *first_output,
        {"type": "function_call_output", "call_id": call["call_id"], "output": '{"weather": "cold"}'},
    ]
    return body


async def test_the_continued_call_is_one_capture_row_and_gym_rebuilds_the_turn(
    servers: CutServers, tmp_path: Path
) -> None:
    store = TokenCaptureStore(tmp_path / "captures")
    # The uninterrupted run of the same turn, for its second call's tokens.
    _, ref_http = servers.build(return_token_id_information=True)
    ref_first = (await ref_http.post(path_of("ref"), json=first_request(conversation("ref")))).json()["output"]
    await ref_http.post(path_of("ref"), json=second_request("ref", ref_first))
    uninterrupted = store.read_entries("ref")[1]

    first, http = servers.build(return_token_id_information=True)
    first_output = (await http.post(path_of(ROLLOUT), json=first_request(conversation(ROLLOUT)))).json()["output"]
    answered = store.read_entries(ROLLOUT)[0].model_call_id
    servers.state.tokens_per_second = 800.0
    before = servers.state.generated_total
    servers.state.pause_at = (f"({ROLLOUT})", servers.state.generated[conversation(ROLLOUT)] + WORDS // 2)
    pending = asyncio.ensure_future(http.post(path_of(ROLLOUT), json=second_request(ROLLOUT, first_output)))
    await _until(lambda: servers.state.paused, "the second call half way")
    assert (await control(http, "prepare", checkpoint_id="ck")).json()["phase"] == "prepared"
    cut = servers.state.generated_total - before
    assert cut == WORDS // 2
    committed = await control(
        http,
        "commit",
        checkpoint_id="ck",
        checkpoint_dir=str(tmp_path / "ck"),
        episode_ids=[{"rollout_id": ROLLOUT, "attempt": 0}],
    )
    assert committed.json()["episode_ids"] == [ROLLOUT], committed.text
    (records,) = [path.read_text().splitlines() for path in (tmp_path / "ck").rglob("records-*.jsonl")]
    (record,) = [json.loads(line) for line in records]
    # One record per episode: the answered call's row and the generating call's cut together.
    assert [call_id for call_id, _line in record["token_rows"]] == [answered]
    assert len(record["generation_cut"]["token_ids"]) == cut
    pending.cancel()
    await asyncio.gather(pending, return_exceptions=True)
    await _until(lambda: servers.state.abandoned_total == 1, "the backend to see the stream dropped")
    await first.control.aclose()
    assert [e.model_call_id for e in store.read_entries(ROLLOUT)] == [answered]  # the cut call wrote no row

    fresh, http2 = servers.build(return_token_id_information=True)
    restore = {"checkpoint_dir": str(tmp_path / "ck"), "episode_ids": [{"rollout_id": ROLLOUT, "attempt": 0}]}
    assert (await control(http2, "restore", checkpoint_id="rs", **restore)).status_code == 200
    await control(http2, "resume", checkpoint_id="rs")
    generated = servers.state.generated_total
    reply = await http2.post(path_of(f"{ROLLOUT}-a1"), json=second_request(ROLLOUT, first_output))
    assert reply.status_code == 200, reply.text
    assert servers.state.generated_total - generated == (WORDS + 8) - cut

    rows = store.read_entries(f"{ROLLOUT}-a1")
    assert len(rows) == 2 and rows[0].model_call_id == answered
    whole = rows[1]
    assert whole.generation_token_ids == uninterrupted.generation_token_ids
    assert whole.generation_log_probs == uninterrupted.generation_log_probs
    built = trajectories_for_rollout(f"{ROLLOUT}-a1", [tmp_path / "captures"])
    assert built is not None and built["mask_sample"] is False, built
    assert built["metrics"]["n_calls"] == 2


async def _until(condition: Any, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)  # wait-ok: polling interval of a bounded condition wait
