"""The model participant's records are versioned: a later checkpoint writes only the episodes whose record changed.

Real ``vllm_model`` servers in process (``model_support.ModelServers``, the fake backend over real
HTTP) with Gym's token capture on, checkpointed through their control routes into sibling
directories. A record holds the episode's rows this server owns (and its generation cut): it
changes with a call delivered, with its capture files (rows another server removed), with a newer
cut, and goes with a retire. Restores from an incremental and from a full checkpoint install the
same capture files, byte for byte, and the same cuts.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from control_support import wait_until
from cut_support import CutServers, final_request, path_of
from model_support import ModelServers
from nemo_gym.token_id_capture import TokenCaptureStore, trajectories_for_rollout
from test_model_capture_shared import OTHER, _ids, _restore, _scope
from test_model_capture_staging import LEDGER_TOKEN_ENV, _manifest, _verified_chain
from test_model_token_capture import capture_path, control, first_request, second_request
from versioned_support import manifest_of, written

from nemo_gym_checkpoint_plugin._storage.layout import participant_dir
from nemo_gym_checkpoint_plugin.testing.fake_staging import StagingDir
from nemo_gym_checkpoint_plugin.testing.gym_config import MODEL

KIND = "model"


def _capture(tmp_path: Path, **more: Any) -> dict[str, Any]:
    return {"token_id_capture": {"enabled": True, "dir": str(tmp_path / "captures"), **more}}


@pytest.fixture
async def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ModelServers]:
    servers = ModelServers(tmp_path, monkeypatch, _capture(tmp_path), replicas=2)
    await servers.start()
    yield servers
    await servers.aclose()


async def _checkpoint(
    https: list[Any], directory: Path, scope: list[dict[str, Any]], ck: str | None = None
) -> list[dict[str, Any]]:
    """Prepare, commit into ``directory`` and resume on every server; the commit replies."""
    ck = ck or directory.name
    for http in https:
        assert (await control(http, "prepare", checkpoint_id=ck)).json()["phase"] == "prepared"
    replies = [await _commit(http, directory, scope, ck) for http in https]
    for http in https:
        assert (await control(http, "resume", checkpoint_id=ck)).status_code == 200
    return replies


async def _commit(http: Any, directory: Path, scope: list[dict[str, Any]], ck: str) -> dict[str, Any]:
    reply = await control(http, "commit", checkpoint_id=ck, checkpoint_dir=str(directory), episode_ids=scope)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _records(directory: Path, instance: str = MODEL) -> dict[str, dict[str, Any]]:
    """The records ``directory``'s checkpoint wrote itself, by capture key."""
    manifest = manifest_of(directory, KIND, instance)
    lines = (participant_dir(directory, KIND, instance) / manifest["records_file"]).read_bytes().splitlines()
    found = {}
    for line in lines:
        record = orjson.loads(line)
        episode = record["episode_id"]
        found[episode["rollout_id"] + (f"-a{episode['attempt']}" if episode["attempt"] else "")] = record
    return found


def _referred(directory: Path, instance: str = MODEL) -> int:
    manifest = manifest_of(directory, KIND, instance)
    return sum(stop - start for segment in manifest.get("segments", ()) for start, stop in segment["lines"])


def _row_ids(record: dict[str, Any]) -> list[str]:
    return [call_id for call_id, _line in record["token_rows"]]


async def test_a_checkpoint_writes_only_the_model_records_changed_since_the_previous_one(
    servers: ModelServers, tmp_path: Path
) -> None:
    store = TokenCaptureStore(tmp_path / "captures")
    first, http = servers.build(return_token_id_information=True)
    outputs = {}
    for name in ("a", "b", "c"):
        reply = await http.post(capture_path(name), json=first_request(name))
        assert reply.status_code == 200, reply.text
        outputs[name] = reply.json()["output"]
    scope = _scope("a", "b", "c")
    root = tmp_path / "ckpts"

    await _checkpoint([http], root / "step-1", scope)
    assert written(root / "step-1", KIND, MODEL) == ["a", "b", "c"]

    # Nothing changed: nothing is written, every record is referred to.
    (reply,) = await _checkpoint([http], root / "step-2", scope)
    second = manifest_of(root / "step-2", KIND, MODEL)
    assert second["schema_version"] == 2 and second["depends_on"] == ["step-1"], second
    assert written(root / "step-2", KIND, MODEL) == [] and reply["episode_ids"] == ["a", "b", "c"]

    # b's second call generates as step-3 is prepared; its response is held at the model server. Gym wrote
    # its row (b's file changed): b is written again, still without that row (it reached no one).
    servers.state.add_rule("(b)", 1, 1)
    pending = asyncio.ensure_future(http.post(capture_path("b"), json=second_request("b", outputs["b"])))
    await wait_until(lambda: len(servers.state.held) == 1, timeout=20, what="b's second call at the backend")
    assert (await control(http, "prepare", checkpoint_id="step-3")).json()["phase"] == "prepared"
    servers.state.release(None)
    await wait_until(lambda: first.participant.held == 1, timeout=20, what="b's second response held")
    assert len(_ids(store, "b")) == 2
    await _commit(http, root / "step-3", scope, "step-3")
    assert written(root / "step-3", KIND, MODEL) == ["b"]
    assert len(_row_ids(_records(root / "step-3")["b"])) == 1
    assert (await control(http, "resume", checkpoint_id="step-3")).status_code == 200
    assert (await pending).status_code == 200

    # Its answer reached the agent after step-3: b's record changes, though its file did not.
    await _checkpoint([http], root / "step-4", scope)
    assert written(root / "step-4", KIND, MODEL) == ["b"]
    assert _row_ids(_records(root / "step-4")["b"]) == _ids(store, "b")

    # c is given up: it goes from the checkpoint, a and b are referred to.
    retired = await control(http, "retire", checkpoint_id="giving-up", episode_ids=_scope("c"))
    assert retired.status_code == 200, retired.text
    (reply,) = await _checkpoint([http], root / "step-5", scope)
    assert written(root / "step-5", KIND, MODEL) == [] and reply["episode_ids"] == ["a", "b"]
    assert _referred(root / "step-5") == 2
    full = tmp_path / "full" / "step-5"
    await _checkpoint([http], full, scope, "full-5")
    assert manifest_of(full, KIND, MODEL)["schema_version"] == 1 and written(full, KIND, MODEL) == ["a", "b"]

    checkpointed = {name: store.path_for(name).read_bytes() for name in ("a", "b")}
    installed = []
    for directory, restore_id in ((root / "step-5", "re-incremental"), (full, "re-full")):
        _fresh, http2 = servers.build(return_token_id_information=True)
        await _restore([http2], directory, scope, restore_id)
        installed.append({key: store.path_for(f"{key}-a1").read_bytes() for key in ("a", "b")})
    # Byte for byte the same files, each the checkpointed attempt's rows as Gym wrote them.
    assert installed[0] == installed[1] == checkpointed
    built = trajectories_for_rollout("b-a1", [tmp_path / "captures"])
    assert built is not None and built["mask_sample"] is False and built["metrics"]["n_calls"] == 2, built


async def test_rows_another_model_server_removed_are_never_referred_to(servers: ModelServers, tmp_path: Path) -> None:
    """A' installed both calls of a restored turn; the agent sends call 2 again to B', which drops A's row of it."""
    store = TokenCaptureStore(tmp_path / "captures")
    _a, http_a = servers.build(MODEL, return_token_id_information=True)
    _b, http_b = servers.build(OTHER, return_token_id_information=True)
    first = await http_a.post(capture_path("r"), json=first_request("r"))
    second = second_request("r", first.json()["output"])
    assert (await http_a.post(capture_path("r"), json=second)).status_code == 200  # its answer lost on the wire
    await _checkpoint([http_a, http_b], tmp_path / "ck", _scope("r"))

    _a2, http_a2 = servers.build(MODEL, return_token_id_information=True)
    _b2, http_b2 = servers.build(OTHER, return_token_id_information=True)
    await _restore([http_a2, http_b2], tmp_path / "ck", _scope("r"))
    key = "r-a1"
    restored = _ids(store, key)
    assert len(restored) == 2
    root = tmp_path / "ckpts"
    await _checkpoint([http_a2, http_b2], root / "step-1", _scope(key))
    assert written(root / "step-1", KIND, MODEL) == [key] and written(root / "step-1", KIND, OTHER) == []
    await _checkpoint([http_a2, http_b2], root / "step-2", _scope(key))
    assert written(root / "step-2", KIND, MODEL) == [] and _referred(root / "step-2") == 1

    again = await http_b2.post(capture_path(key), json=second)
    assert again.status_code == 200, again.text
    rows = _ids(store, key)
    assert rows[0] == restored[0] and restored[1] not in rows and len(rows) == 2, rows
    await _checkpoint([http_a2, http_b2], root / "step-3", _scope(key))
    # A's rows changed on disk with no call of its own: its record is written again, without the dropped row.
    assert written(root / "step-3", KIND, MODEL) == [key]
    assert _row_ids(_records(root / "step-3")[key]) == [restored[0]]
    assert _row_ids(_records(root / "step-3", OTHER)[key]) == [rows[1]]

    _a3, http_a3 = servers.build(MODEL, return_token_id_information=True)
    _b3, http_b3 = servers.build(OTHER, return_token_id_information=True)
    await _restore([http_a3, http_b3], root / "step-3", _scope(key), "restore-3")
    assert sorted(_ids(store, "r-a2")) == sorted(rows)
    built = trajectories_for_rollout("r-a2", [tmp_path / "captures"])
    assert built is not None and built["mask_sample"] is False and built["metrics"]["n_calls"] == 2, built


async def test_referred_records_keep_their_staged_keys_and_a_new_staged_row_writes_its_episode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LEDGER_TOKEN_ENV, "ledger-control-token")
    servers = ModelServers(tmp_path, monkeypatch, _capture(tmp_path, external_staging=True, rebuild_response=False))
    await servers.start()
    try:
        _a, http = servers.build(MODEL)
        outputs = {}
        for name in ("s1", "s2"):
            reply = await http.post(capture_path(name), json=first_request(name))
            assert reply.status_code == 200, reply.text
            outputs[name] = reply.json()["output"]
        root, scope = tmp_path / "ckpts", _scope("s1", "s2")
        (one,) = await _checkpoint([http], root / "step-1", scope)
        assert written(root / "step-1", KIND, MODEL) == ["s1", "s2"]
        assert sorted(one["staging_keys_by_episode"]) == ["s1", "s2"] and len(one["staging_keys"]) == 2
        (two,) = await _checkpoint([http], root / "step-2", scope)
        assert written(root / "step-2", KIND, MODEL) == []
        # The reply names the staged keys of the records it refers to, as a full checkpoint's does.
        assert (two["staging_keys"], two["staging_keys_by_episode"]) == (
            one["staging_keys"],
            one["staging_keys_by_episode"],
        )

        assert (await http.post(capture_path("s2"), json=second_request("s2", outputs["s2"]))).status_code == 200
        (three,) = await _checkpoint([http], root / "step-3", scope)
        assert written(root / "step-3", KIND, MODEL) == ["s2"]
        assert three["staging_keys_by_episode"]["s1"] == one["staging_keys_by_episode"]["s1"]
        assert len(three["staging_keys_by_episode"]["s2"]) == 2 and len(three["staging_keys"]) == 3

        _fresh, http2 = servers.build(MODEL)
        await _restore([http2], root / "step-3", scope)
        for key, calls in (("s1-a1", 1), ("s2-a1", 2)):
            manifest = await _manifest(tmp_path, key)
            assert manifest.failures == [] and len(manifest.records) == calls, manifest
            assert len(_verified_chain(manifest, StagingDir(servers.staging_dir))) == calls
    finally:
        await servers.aclose()


async def test_a_newer_cut_is_written_and_an_unchanged_one_referred_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The backend pauses itself at a token count and stays paused (no worker freeze): the cut stands still.
    servers = CutServers(
        tmp_path,
        monkeypatch,
        cuts={"tool_call_parser": "hermes", "freeze_worker": False},
        extra_config=_capture(tmp_path),
    )
    await servers.start()
    store = TokenCaptureStore(tmp_path / "captures")
    call = None
    try:
        first, http = servers.build(return_token_id_information=True)
        # q: one answered call (a captured row, no cut); g: a long answer generating (a cut, no row).
        assert (await http.post(capture_path("q"), json=first_request("q"))).status_code == 200
        servers.state.tokens_per_second = 800.0
        conversation = "long answer please (g) [answer_words=200]"
        servers.state.pause_at = ("(g)", 40)
        call = asyncio.ensure_future(http.post(path_of("g"), json=final_request(conversation)))
        await wait_until(lambda: servers.state.paused, timeout=20, what="g's generation at 40 tokens")
        root, scope = tmp_path / "ckpts", _scope("g", "q")

        await _checkpoint([http], root / "step-1", scope)
        assert sorted(written(root / "step-1", KIND, MODEL)) == ["g", "q"]
        assert len(_records(root / "step-1")["g"]["generation_cut"]["token_ids"]) == 40
        await _checkpoint([http], root / "step-2", scope)
        assert written(root / "step-2", KIND, MODEL) == []  # the cut stood still

        servers.state.pause_at = ("(g)", 80)
        servers.state.resume()
        await wait_until(lambda: servers.state.paused, timeout=20, what="g's generation at 80 tokens")
        await _checkpoint([http], root / "step-3", scope)
        assert written(root / "step-3", KIND, MODEL) == ["g"]
        cut = _records(root / "step-3")["g"]["generation_cut"]
        assert len(cut["token_ids"]) == 80
        full = tmp_path / "full" / "step-3"
        await _checkpoint([http], full, scope, "full-3")
        assert sorted(written(full, KIND, MODEL)) == ["g", "q"]

        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        await first.control.aclose()
        restored = []
        for directory, restore_id in ((root / "step-3", "re-incremental"), (full, "re-full")):
            fresh, http2 = servers.build(return_token_id_information=True)
            await _restore([http2], directory, scope, restore_id)
            assert fresh.participant.cuts is not None
            restored.append((dict(fresh.participant.cuts.restored), store.path_for("q-a1").read_bytes()))
        assert restored[0] == restored[1]
        assert restored[0][0] == {"g-a1": cut}
    finally:
        if call is not None:
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
        servers.state.resume()
        await servers.aclose()


def test_a_capture_file_s_fingerprint_changes_with_every_change_of_its_rows(tmp_path: Path) -> None:
    from nemo_gym_checkpoint_plugin.builtin_participants.model.capture_files import TOKEN_ROWS, CaptureDir

    files = CaptureDir(tmp_path)
    assert files.fingerprint("r", TOKEN_ROWS) is None and files.read_lines("r", TOKEN_ROWS) == ([], None)
    files.append("r", TOKEN_ROWS, [("c1", b'{"model_call_id":"c1"}\n')])
    before = files.fingerprint("r", TOKEN_ROWS)
    lines, read = files.read_lines("r", TOKEN_ROWS)
    assert lines == [b'{"model_call_id":"c1"}'] and read == before == files.fingerprint("r", TOKEN_ROWS)
    # Replaced by rows of the same size (a row dropped, another written): another file, another fingerprint.
    files.replace("r", TOKEN_ROWS, [b'{"model_call_id":"c2"}\n'])
    assert files.fingerprint("r", TOKEN_ROWS) != before
    replaced = files.fingerprint("r", TOKEN_ROWS)
    files.append("r", TOKEN_ROWS, [("c3", b'{"model_call_id":"c3"}\n')])
    assert files.fingerprint("r", TOKEN_ROWS) not in (before, replaced)
    os.unlink(files.path("r", TOKEN_ROWS))
    assert files.fingerprint("r", TOKEN_ROWS) is None


def test_a_file_that_changed_while_it_was_read_gets_a_fingerprint_nothing_equals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nemo_gym_checkpoint_plugin.builtin_participants.model.capture_files import TOKEN_ROWS, CaptureDir

    files = CaptureDir(tmp_path)
    files.append("r", TOKEN_ROWS, [("c1", b'{"model_call_id":"c1"}\n')])
    real, seen = os.fstat, []

    def appended_meanwhile(descriptor: int) -> os.stat_result:
        status = real(descriptor)
        seen.append(status)
        if len(seen) == 1:  # read_lines' first look, before its read: a row is appended right after it
            with open(files.path("r", TOKEN_ROWS), "ab") as handle:
                handle.write(b'{"model_call_id":"c2"}\n')
        return status

    monkeypatch.setattr(os, "fstat", appended_meanwhile)
    lines, read = files.read_lines("r", TOKEN_ROWS)
    monkeypatch.setattr(os, "fstat", real)
    assert len(lines) == 2 and len(seen) == 2
    # The bytes read are neither the file as first looked at nor (in general) as it is: no fingerprint of
    # either may stand for them, else a later file equal to the first look would refer to these rows.
    first_look = (seen[0].st_dev, seen[0].st_ino, seen[0].st_size, seen[0].st_mtime_ns, seen[0].st_ctime_ns)
    now = files.fingerprint("r", TOKEN_ROWS)
    assert read not in (first_look, now) and files.read_lines("r", TOKEN_ROWS)[1] == now
