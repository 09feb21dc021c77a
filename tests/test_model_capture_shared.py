"""Gym's capture directory shared by several model servers, across a checkpoint and a "crash" (fresh servers).

Real ``vllm_model`` servers in process (``model_support.ModelServers``, the fake backend over real
HTTP), each built as its own process would be, all writing the one run-wide capture directory
Gym's trainer reads. What the trainer reads after a restore is checked with Gym's own rebuild
(``trajectories_for_rollout``) and Gym's own store.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from control_support import wait_until
from model_support import ModelServers
from nemo_gym.token_id_capture import TokenCaptureStore, trajectories_for_rollout
from test_model_token_capture import capture_path, control, dead_executions, first_request, second_request

from nemo_gym_checkpoint_plugin.testing.gym_config import MODEL

OTHER = "policy_model_2"  # the second model server of the config (a judge, a replica): same capture directory
ROLLOUT = "tc"


@pytest.fixture
async def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ModelServers]:
    capture = {"enabled": True, "dir": str(tmp_path / "captures")}
    servers = ModelServers(tmp_path, monkeypatch, {"token_id_capture": capture}, replicas=2)
    await servers.start()
    yield servers
    await servers.aclose()


def _scope(*keys: str) -> list[dict[str, Any]]:
    from nemo_gym_checkpoint_plugin._identity import from_capture_key

    return [{"rollout_id": e.rollout_id, "attempt": e.attempt} for e in map(from_capture_key, keys)]


async def _checkpoint(
    https: list[Any], checkpoint_dir: Path, scope: list[dict[str, Any]], ck: str = "ck-1"
) -> list[Any]:
    for http in https:
        assert (await control(http, "prepare", checkpoint_id=ck)).json()["phase"] == "prepared"
    replies = []
    for http in https:
        reply = await control(http, "commit", checkpoint_id=ck, checkpoint_dir=str(checkpoint_dir), episode_ids=scope)
        assert reply.status_code == 200, reply.text
        replies.append(reply.json())
    return replies


async def _restore(https: list[Any], checkpoint_dir: Path, scope: list[dict[str, Any]], rid: str = "restore-1") -> None:
    for http in https:
        reply = await control(http, "restore", checkpoint_id=rid, checkpoint_dir=str(checkpoint_dir), episode_ids=scope)
        assert reply.status_code == 200, reply.text
    for http in https:
        assert (await control(http, "resume", checkpoint_id=rid)).status_code == 200


def _ids(store: TokenCaptureStore, key: str) -> list[str]:
    return [entry.model_call_id for entry in store.read_entries(key)]


def _rebuilt(tmp_path: Path, key: str) -> dict[str, Any]:
    built = trajectories_for_rollout(key, [tmp_path / "captures"])
    assert built is not None
    return built


async def test_two_model_servers_on_one_directory_export_only_the_calls_each_answered(
    servers: ModelServers, tmp_path: Path
) -> None:
    """A answers call 1 and holds call 2 at the checkpoint; B served nothing: B exports nothing, A one row."""
    store = TokenCaptureStore(tmp_path / "captures")
    a, http_a = servers.build(MODEL, return_token_id_information=True)
    b, http_b = servers.build(OTHER, return_token_id_information=True)
    first = await http_a.post(capture_path(ROLLOUT), json=first_request(ROLLOUT))
    assert first.status_code == 200, first.text
    answered = _ids(store, ROLLOUT)
    servers.state.add_rule("weather please", 1, 1)
    pending = asyncio.ensure_future(
        http_a.post(capture_path(ROLLOUT), json=second_request(ROLLOUT, first.json()["output"]))
    )
    await wait_until(lambda: len(servers.state.held) == 1, timeout=20, what="call 2 at the backend")
    for http in (http_a, http_b):
        assert (await control(http, "prepare", checkpoint_id="ck-1")).json()["phase"] == "prepared"
    servers.state.release(None)
    await wait_until(lambda: a.participant.held == 1, timeout=20, what="call 2's response held at A")
    assert len(_ids(store, ROLLOUT)) == 2  # Gym captured call 2 before its response was held
    ck = tmp_path / "ck"
    replies = []
    for http in (http_a, http_b):
        reply = await control(http, "commit", checkpoint_id="ck-1", checkpoint_dir=str(ck), episode_ids=_scope(ROLLOUT))
        replies.append(reply.json())
    assert [r["episode_ids"] for r in replies] == [[ROLLOUT], []], replies
    pending.cancel()

    # The crash: fresh A' and B' restore; the agent sends call 2 again as attempt 1, to A'.
    _fresh_a, http_a2 = servers.build(MODEL, return_token_id_information=True)
    _fresh_b, http_b2 = servers.build(OTHER, return_token_id_information=True)
    await _restore([http_a2, http_b2], ck, _scope(ROLLOUT))
    assert _ids(store, f"{ROLLOUT}-a1") == answered
    again = await http_a2.post(capture_path(f"{ROLLOUT}-a1"), json=second_request(ROLLOUT, first.json()["output"]))
    assert again.status_code == 200, again.text
    built = _rebuilt(tmp_path, f"{ROLLOUT}-a1")
    assert built["mask_sample"] is False and built["metrics"]["n_calls"] == 2, built


async def test_an_answer_that_never_reached_the_agent_is_left_out_when_the_call_is_sent_again(
    servers: ModelServers, tmp_path: Path
) -> None:
    """Call 2's answer went out before the checkpoint, but the agent's boundary is before it (it never got it)."""
    store = TokenCaptureStore(tmp_path / "captures")
    a, http_a = servers.build(MODEL, return_token_id_information=True)
    first = await http_a.post(capture_path(ROLLOUT), json=first_request(ROLLOUT))
    second = second_request(ROLLOUT, first.json()["output"])
    lost = await http_a.post(capture_path(ROLLOUT), json=second)  # on the wire when everything died
    assert lost.status_code == 200
    ck = tmp_path / "ck"
    (reply,) = await _checkpoint([http_a], ck, _scope(ROLLOUT))
    assert reply["episode_ids"] == [ROLLOUT]
    kept = _ids(store, ROLLOUT)
    assert len(kept) == 2  # both rows exported: call 2's answer had started reaching its caller

    _fresh, http_a2 = servers.build(MODEL, return_token_id_information=True)
    await _restore([http_a2], ck, _scope(ROLLOUT))
    assert _ids(store, f"{ROLLOUT}-a1") == kept
    again = await http_a2.post(capture_path(f"{ROLLOUT}-a1"), json=second)
    assert again.status_code == 200, again.text
    ids = _ids(store, f"{ROLLOUT}-a1")
    assert ids[0] == kept[0] and kept[1] not in ids and len(ids) == 2, (kept, ids)
    # The continued turn goes on from the new answer: Gym resolves its parent, nothing is masked.
    final = second_request(ROLLOUT, first.json()["output"])
    final["input"] += [*again.json()["output"]]
    assert (await http_a2.post(capture_path(f"{ROLLOUT}-a1"), json=final)).status_code == 200
    built = _rebuilt(tmp_path, f"{ROLLOUT}-a1")  # Gym's rebuild freezes the rollout: the last step
    assert built["mask_sample"] is False and built["metrics"]["n_calls"] == 3, built


async def test_installs_of_servers_sharing_a_directory_keep_each_others_rows(
    servers: ModelServers, tmp_path: Path
) -> None:
    """Policy and judge both wrote rows of one rollout; a dead execution left attempt 1 files; both restore."""
    store = TokenCaptureStore(tmp_path / "captures")
    _a, http_a = servers.build(MODEL, return_token_id_information=True)
    _b, http_b = servers.build(OTHER, return_token_id_information=True)
    assert (await http_a.post(capture_path(ROLLOUT), json=first_request(ROLLOUT))).status_code == 200
    judged = {"input": [{"role": "user", "content": f"judge this ({ROLLOUT})"}]}
    assert (await http_b.post(capture_path(ROLLOUT), json=judged)).status_code == 200
    policy_row, judge_row = _ids(store, ROLLOUT)
    ck = tmp_path / "ck"
    replies = await _checkpoint([http_a, http_b], ck, _scope(ROLLOUT))
    assert [r["episode_ids"] for r in replies] == [[ROLLOUT], [ROLLOUT]]
    dead_executions(store)

    _a2, http_a2 = servers.build(MODEL, return_token_id_information=True)
    _b2, http_b2 = servers.build(OTHER, return_token_id_information=True)
    await _restore([http_a2, http_b2], ck, _scope(ROLLOUT))  # A' installs first, then B'
    assert sorted(_ids(store, f"{ROLLOUT}-a1")) == sorted([policy_row, judge_row])
    assert not store.state_path_for(f"{ROLLOUT}-a2").exists()  # the dead attempt 2 went too


async def test_a_restored_attempt_another_server_started_is_never_deleted_as_unscoped(
    servers: ModelServers, tmp_path: Path
) -> None:
    store = TokenCaptureStore(tmp_path / "captures")
    _a, http_a = servers.build(MODEL, return_token_id_information=True)
    _b, http_b = servers.build(OTHER, return_token_id_information=True)
    first = await http_a.post(capture_path(ROLLOUT), json=first_request(ROLLOUT))
    judged = {"input": [{"role": "user", "content": f"judge this ({ROLLOUT})"}]}
    assert (await http_b.post(capture_path(ROLLOUT), json=judged)).status_code == 200
    ck = tmp_path / "ck"
    await _checkpoint([http_a, http_b], ck, _scope(ROLLOUT))

    a2, http_a2 = servers.build(MODEL, return_token_id_information=True)
    b2, http_b2 = servers.build(OTHER, return_token_id_information=True)
    await _restore([http_a2, http_b2], ck, _scope(ROLLOUT))
    key = f"{ROLLOUT}-a1"
    assert b2.participant.restored_pending() == [key]
    # The continued rollout's next call goes to A' only, and the rollout finishes there.
    again = await http_a2.post(capture_path(key), json=second_request(ROLLOUT, first.json()["output"]))
    assert again.status_code == 200
    rows = _ids(store, key)
    assert len(rows) == 3
    # B' commits a later checkpoint whose scope leaves the finished attempt out: it must not delete A's rows.
    (reply,) = await _checkpoint([http_b2], tmp_path / "ck2", _scope("other-0"), ck="ck-2")
    await wait_until(lambda: b2.participant.restored_pending() == [], timeout=20, what="B' settled the attempt")
    await control(http_b2, "resume", checkpoint_id="ck-2")
    assert _ids(store, key) == rows


async def test_a_failed_delete_keeps_the_attempt_until_a_later_commit_deletes_it(
    servers: ModelServers, tmp_path: Path
) -> None:
    store = TokenCaptureStore(tmp_path / "captures")
    _a, http_a = servers.build(MODEL, return_token_id_information=True)
    for rollout in ("kept", "dropped"):
        assert (await http_a.post(capture_path(rollout), json=first_request(rollout))).status_code == 200
    ck = tmp_path / "ck"
    await _checkpoint([http_a], ck, _scope("kept", "dropped"))
    a2, http_a2 = servers.build(MODEL, return_token_id_information=True)
    await _restore([http_a2], ck, _scope("kept", "dropped"))
    # A directory where a file of the attempt is: its delete fails (unlink: EISDIR), as on a broken filesystem.
    blocker = tmp_path / "captures" / "dropped-a1.tokens.intents"
    blocker.mkdir()
    await _checkpoint([http_a2], tmp_path / "ck2", _scope("kept-a1"), ck="ck-2")
    await control(http_a2, "resume", checkpoint_id="ck-2")  # waits for the commit's clean-up
    assert a2.participant.restored_pending() == ["dropped-a1", "kept-a1"]  # still known: to be deleted again
    blocker.rmdir()
    await _checkpoint([http_a2], tmp_path / "ck3", _scope("kept-a1"), ck="ck-3")
    await control(http_a2, "resume", checkpoint_id="ck-3")
    assert a2.participant.restored_pending() == ["kept-a1"]
    assert not store.path_for("dropped-a1").exists() and store.path_for("kept-a1").exists()


async def test_the_checkpointed_attempt_s_files_go_once_the_restore_installed_them(
    servers: ModelServers, tmp_path: Path
) -> None:
    store = TokenCaptureStore(tmp_path / "captures")
    _a, http_a = servers.build(MODEL, return_token_id_information=True)
    assert (await http_a.post(capture_path(ROLLOUT), json=first_request(ROLLOUT))).status_code == 200
    ck = tmp_path / "ck"
    await _checkpoint([http_a], ck, _scope(ROLLOUT))
    assert store.path_for(ROLLOUT).exists()
    _a2, http_a2 = servers.build(MODEL, return_token_id_information=True)
    await _restore([http_a2], ck, _scope(ROLLOUT))
    await wait_until(
        lambda: (
            not any(
                p.name.startswith(f"{ROLLOUT}.tokens.") and not p.name.endswith(".lock")
                for p in (tmp_path / "captures").iterdir()
            )
        ),
        timeout=20,
        what="attempt 0's capture files removed",
    )
    assert len(_ids(store, f"{ROLLOUT}-a1")) == 1


async def test_a_restore_id_used_again_after_its_resume_clears_again(servers: ModelServers, tmp_path: Path) -> None:
    """The marker that one server cleared a restore's dead executions lasts until that restore is resumed."""
    store = TokenCaptureStore(tmp_path / "captures")
    _a, http_a = servers.build(MODEL, return_token_id_information=True)
    first = await http_a.post(capture_path(ROLLOUT), json=first_request(ROLLOUT))
    ck = tmp_path / "ck"
    await _checkpoint([http_a], ck, _scope(ROLLOUT))
    checkpointed = _ids(store, ROLLOUT)
    _a2, http_a2 = servers.build(MODEL, return_token_id_information=True)
    await _restore([http_a2], ck, _scope(ROLLOUT))
    await wait_until(
        lambda: not list((tmp_path / "captures").glob(".ng-checkpoint-restore-*")),
        timeout=20,
        what="the restore's marker removed at its resume",
    )
    # The continued attempt runs a call, then everything dies again; the same checkpoint is restored
    # under the same restore id: what the dead continuation wrote must go.
    again = await http_a2.post(capture_path(f"{ROLLOUT}-a1"), json=second_request(ROLLOUT, first.json()["output"]))
    assert again.status_code == 200 and len(_ids(store, f"{ROLLOUT}-a1")) == 2
    _a3, http_a3 = servers.build(MODEL, return_token_id_information=True)
    await _restore([http_a3], ck, _scope(ROLLOUT))
    assert _ids(store, f"{ROLLOUT}-a1") == checkpointed


async def test_a_retire_of_restored_attempts_deletes_theirs_and_forgets_what_they_owned(
    servers: ModelServers, tmp_path: Path
) -> None:
    store = TokenCaptureStore(tmp_path / "captures")
    _a, http_a = servers.build(MODEL, return_token_id_information=True)
    for rollout in ("one", "two"):
        assert (await http_a.post(capture_path(rollout), json=first_request(rollout))).status_code == 200
    ck = tmp_path / "ck"
    await _checkpoint([http_a], ck, _scope("one", "two"))
    a2, http_a2 = servers.build(MODEL, return_token_id_information=True)
    await _restore([http_a2], ck, _scope("one", "two"))
    book = a2.participant.book
    assert sorted(book.owned) == ["one-a1", "two-a1"]
    # The controller gives "one" up: it retires the replacement (and everything before it).
    reply = await control(http_a2, "retire", checkpoint_id="giving-up", episode_ids=_scope("one-a1"))
    assert reply.status_code == 200, reply.text
    assert a2.participant.restored_pending() == ["two-a1"] and sorted(book.owned) == ["two-a1"]
    assert not store.path_for("one-a1").exists() and store.path_for("two-a1").exists()


def test_rows_are_carried_as_their_lines_and_records_of_earlier_releases_still_restore(tmp_path: Path) -> None:
    import orjson
    from nemo_gym_checkpoint_plugin.builtin_participants.model.token_capture import TokenCaptures

    from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState

    store = TokenCaptureStore(tmp_path / "captures")
    from nemo_gym.token_id_capture.records import TokenEntry

    store.append(
        TokenEntry(
            rollout_id="r",
            model_call_id="c1",
            prompt_token_ids=[1, 2],
            generation_token_ids=[3],
            generation_log_probs=[-0.5],
        )
    )
    captures = TokenCaptures(store)
    (record,) = captures.export(["r"], {"r": {"c1"}})
    line = store.path_for("r").read_bytes()
    # The row exactly as Gym wrote it, never parsed or encoded again.
    assert record["token_rows"] == [["c1", line.rstrip(b"\n").decode()]]
    assert captures.stage("r", "r-a1", record).tokens == [("c1", line)]
    # An earlier release's record held the row as a JSON object: the same line is written.
    earlier = {"episode_id": record["episode_id"], "token_entries": [orjson.loads(line)]}
    assert captures.stage("r", "r-a1", earlier).tokens == [("c1", line)]
    forged = {"episode_id": record["episode_id"], "token_rows": [["c2", line.rstrip(b"\n").decode()]]}
    with pytest.raises(InvalidCheckpointState, match="not one JSON row of that model call"):
        captures.stage("r", "r-a1", forged)
