"""External token staging across a checkpoint: the ledger rows Gym's model server writes, exported, restored, exact.

``token_id_capture.external_staging: true`` (backend ``vllm_worker``): the fake backend stages each
admitted call the way a vLLM worker with Gym's capture does (``fake_staging.py``, Gym's own
``RolloutTokenCapture``), and Gym's ``vllm_model`` (in process) records a ledger row per call in
``<key>.lineage.jsonl``. After a restore the ledger of the continued attempt must hold every call
of the turn once, its staged chain verifiable: each delta extends its parent's chain hash and the
terminal's cumulative hash covers the whole sequence (what Gym's ``verify_and_linearize`` checks;
that function also requires every staged row to carry the receipt's rollout id, while the rows of
the calls before the crash keep the attempt that staged them, so the checks are made here).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from control_support import wait_until
from model_support import ModelServers
from nemo_gym.token_id_capture import FileLineageStore
from nemo_gym.token_id_capture.staging import compute_chain_hash, hash_token_ids, select_terminal_call
from nemo_gym.token_id_capture.staging.records import RolloutManifest
from test_model_capture_shared import _restore, _scope
from test_model_token_capture import capture_path, control, first_request, second_request

from nemo_gym_checkpoint_plugin.testing.fake_staging import StagingDir
from nemo_gym_checkpoint_plugin.testing.gym_config import MODEL

ROLLOUT = "st"
LEDGER_TOKEN_ENV = "NEMO_GYM_TOKEN_CAPTURE_CONTROL_TOKEN"


@pytest.fixture
async def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ModelServers]:
    monkeypatch.setenv(LEDGER_TOKEN_ENV, "ledger-control-token")
    capture = {"enabled": True, "dir": str(tmp_path / "captures"), "external_staging": True, "rebuild_response": False}
    servers = ModelServers(tmp_path, monkeypatch, {"token_id_capture": capture})
    await servers.start()
    yield servers
    await servers.aclose()


async def _manifest(tmp_path: Path, key: str) -> RolloutManifest:
    return RolloutManifest.model_validate(await FileLineageStore(tmp_path / "captures").manifest(key))


def _verified_chain(manifest: RolloutManifest, staging: StagingDir) -> list[str]:
    """The terminal chain's model call ids, once its staged deltas verify against the ledger."""
    selection = select_terminal_call(manifest.records)
    assert selection.terminal_model_call_id is not None, selection
    by_id = {record.model_call_id: record for record in manifest.records}
    chain = []
    cursor = by_id[selection.terminal_model_call_id]
    while cursor is not None:
        chain.append(cursor)
        cursor = by_id.get(cursor.parent_call_id) if cursor.parent_call_id else None
    chain.reverse()
    running, tokens = None, []
    for record, snapshot in zip(chain, staging.fetch([r.staging_key for r in chain]), strict=True):
        assert (snapshot.model_call_id, snapshot.digest) == (record.model_call_id, record.digest)
        running = compute_chain_hash(running, snapshot.token_ids_delta)
        assert record.chain_hash == running, f"call {record.model_call_id} does not extend its parent's chain"
        tokens += snapshot.token_ids_delta
    assert chain[-1].cumulative_hash == hash_token_ids(tokens)
    return [record.model_call_id for record in chain]


async def test_a_held_call_s_ledger_row_stays_out_and_the_continued_ledger_verifies(
    servers: ModelServers, tmp_path: Path
) -> None:
    staging = StagingDir(servers.staging_dir)
    a, http = servers.build(MODEL)
    first = await http.post(capture_path(ROLLOUT), json=first_request(ROLLOUT))
    assert first.status_code == 200, first.text
    (answered,) = [r.model_call_id for r in (await _manifest(tmp_path, ROLLOUT)).records]
    servers.state.add_rule("weather please", 1, 1)
    second = second_request(ROLLOUT, first.json()["output"])
    pending = asyncio.ensure_future(http.post(capture_path(ROLLOUT), json=second))
    await wait_until(lambda: len(servers.state.held) == 1, timeout=20, what="call 2 at the worker")
    assert (await control(http, "prepare", checkpoint_id="ck-1")).json()["phase"] == "prepared"
    servers.state.release(None)
    await wait_until(lambda: a.participant.held == 1, timeout=20, what="call 2's response held")
    assert len((await _manifest(tmp_path, ROLLOUT)).records) == 2  # its ledger row exists already
    ck = tmp_path / "ck"
    reply = await control(http, "commit", checkpoint_id="ck-1", checkpoint_dir=str(ck), episode_ids=_scope(ROLLOUT))
    assert reply.status_code == 200, reply.text
    committed = reply.json()
    staged_key = f"{ROLLOUT}/{answered}"
    assert committed["staging_keys"] == [staged_key], committed
    assert committed["staging_keys_by_episode"] == {ROLLOUT: [staged_key]}, committed
    pending.cancel()

    _fresh, http2 = servers.build(MODEL)
    await _restore([http2], ck, _scope(ROLLOUT))
    key = f"{ROLLOUT}-a1"
    assert [r.model_call_id for r in (await _manifest(tmp_path, key)).records] == [answered]
    again = await http2.post(capture_path(key), json=second)
    assert again.status_code == 200, again.text
    manifest = await _manifest(tmp_path, key)
    assert manifest.failures == [] and len(manifest.records) == 2, manifest
    assert _verified_chain(manifest, staging)[0] == answered


async def test_a_ledger_row_whose_answer_never_reached_the_agent_is_left_out_when_sent_again(
    servers: ModelServers, tmp_path: Path
) -> None:
    staging = StagingDir(servers.staging_dir)
    _a, http = servers.build(MODEL)
    first = await http.post(capture_path(ROLLOUT), json=first_request(ROLLOUT))
    second = second_request(ROLLOUT, first.json()["output"])
    assert (await http.post(capture_path(ROLLOUT), json=second)).status_code == 200  # lost on the wire
    exported = [r.model_call_id for r in (await _manifest(tmp_path, ROLLOUT)).records]
    assert (await control(http, "prepare", checkpoint_id="ck-1")).json()["phase"] == "prepared"
    ck = tmp_path / "ck"
    reply = await control(http, "commit", checkpoint_id="ck-1", checkpoint_dir=str(ck), episode_ids=_scope(ROLLOUT))
    assert len(reply.json()["staging_keys"]) == 2

    _fresh, http2 = servers.build(MODEL)
    await _restore([http2], ck, _scope(ROLLOUT))
    key = f"{ROLLOUT}-a1"
    again = await http2.post(capture_path(key), json=second)
    assert again.status_code == 200, again.text
    manifest = await _manifest(tmp_path, key)
    ids = [r.model_call_id for r in manifest.records]
    assert manifest.failures == [] and len(ids) == 2 and ids[0] == exported[0] and exported[1] not in ids, ids
    assert _verified_chain(manifest, staging) == ids


def test_the_fake_worker_stages_nothing_without_an_admission(tmp_path: Path) -> None:
    from nemo_gym_checkpoint_plugin.testing.fake_staging import stage_completion

    completion: dict[str, Any] = {"choices": []}
    stage_completion({"messages": []}, completion, StagingDir(tmp_path))
    assert "ng_commit_coords" not in completion and not any(tmp_path.iterdir())
