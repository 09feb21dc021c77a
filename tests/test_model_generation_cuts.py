"""Generation cuts on an in-process ``vllm_model``: a generation in flight at a checkpoint survives a "crash".

The fake backend runs under real uvicorn and generates token by token; the model server (built as
a restarted process is, empty) is driven over ASGI. A "crash" abandons the old server's call (its
connection to the backend drops) and builds a fresh server on the same config, which restores.
The answers are compared with an uninterrupted run's token for token (text, token ids, logprobs),
and the backend's own count says what it generated.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from cut_support import CutServers, control, final_request, path_of
from model_support import same_answer

from nemo_gym_checkpoint_plugin._markers import hookimpl
from nemo_gym_checkpoint_plugin._types import Readiness

HERMES = {"tool_call_parser": "hermes"}
WORDS = 300
ANSWER_TOKENS = 7 + WORDS + 1  # the sentence, the extra words, the end token
RATE = 600.0


@pytest.fixture
async def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[CutServers]:
    servers = CutServers(tmp_path, monkeypatch, cuts=HERMES)
    await servers.start()
    yield servers
    await servers.aclose()


def conversation(name: str) -> str:
    return f"long answer please ({name}) [answer_words={WORDS}]"


def tokens_of(reply: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Every output item's text and token fields, in order: what must be equal token for token."""
    found = []
    for item in reply["output"]:
        text = "".join(part.get("text", "") for part in item.get("content") or [])
        found.append((item["type"], text, item.get("generation_token_ids"), item.get("generation_log_probs")))
    return found


async def reference(servers: CutServers, name: str) -> dict[str, Any]:
    """The uninterrupted answer (its own server, cuts off), then clean backend counters."""
    _, http = servers.build(return_token_id_information=True)
    reply = await http.post(path_of(f"ref-{name}"), json=final_request(conversation(name)))
    assert reply.status_code == 200, reply.text
    servers.state.reset()
    servers.state.tokens_per_second = RATE
    return reply.json()


async def start_call(http: Any, key: str, name: str) -> asyncio.Future[Any]:
    return asyncio.ensure_future(http.post(path_of(key), json=final_request(conversation(name))))


async def test_a_cut_restored_after_a_crash_continues_with_only_the_remainder_generated(
    servers: CutServers, tmp_path: Path
) -> None:
    expected = await reference(servers, "c1")
    first, http = servers.build(return_token_id_information=True)
    servers.state.pause_at = ("(c1)", ANSWER_TOKENS // 3)  # the generation stands a third of the way at the checkpoint
    call = await start_call(http, "c1", "c1")
    await _until(lambda: servers.state.paused, "the generation a third of the way")
    prepared = (await control(http, "prepare", checkpoint_id="ck-1")).json()
    assert prepared["phase"] == "prepared", prepared
    assert servers.state.paused and servers.state.pauses_total == 2  # the model server froze it in place too
    cut = servers.state.generated_total
    assert cut == ANSWER_TOKENS // 3
    committed = await control(
        http,
        "commit",
        checkpoint_id="ck-1",
        checkpoint_dir=str(tmp_path / "ck"),
        episode_ids=[{"rollout_id": "c1", "attempt": 0}],
    )
    assert committed.status_code == 200 and committed.json()["episode_ids"] == ["c1"], committed.text
    assert servers.state.generated_total == cut and not call.done()

    # The crash: the old process's call is gone (the backend sees its stream dropped); a fresh one restores.
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    await _until(lambda: servers.state.abandoned_total == 1, "the backend to see the stream dropped")
    await first.control.aclose()
    fresh, http2 = servers.build(return_token_id_information=True)
    restore = {"checkpoint_dir": str(tmp_path / "ck"), "episode_ids": [{"rollout_id": "c1", "attempt": 0}]}
    restored = await control(http2, "restore", checkpoint_id="rs-1", **restore)
    assert restored.status_code == 200 and restored.json()["restored"] == ["c1-a1"], restored.text
    assert not servers.state.paused  # the restore resumed the worker the dead server had frozen
    await control(http2, "resume", checkpoint_id="rs-1")

    before = servers.state.generated_total
    reply = await http2.post(path_of("c1-a1"), json=final_request(conversation("c1")))
    assert reply.status_code == 200, reply.text
    generated_after = servers.state.generated_total - before
    assert (cut, generated_after) == (cut, ANSWER_TOKENS - cut), "only the remainder after the cut is generated"
    assert tokens_of(reply.json()) == tokens_of(expected)
    assert same_answer(reply.json()["output"], expected["output"])
    status = (await fresh.status())["generation_cuts"]
    assert status["continued_total"] == 1 and status["tokens_continued_total"] == cut


async def test_without_a_crash_nothing_is_generated_twice(servers: CutServers, tmp_path: Path) -> None:
    expected = await reference(servers, "nc")
    _, http = servers.build(return_token_id_information=True)
    servers.state.pause_at = ("(nc)", ANSWER_TOKENS // 2)
    call = await start_call(http, "nc", "nc")
    await _until(lambda: servers.state.paused, "the generation half way")
    assert (await control(http, "prepare", checkpoint_id="ck-nc")).json()["phase"] == "prepared"
    committed = await control(
        http,
        "commit",
        checkpoint_id="ck-nc",
        checkpoint_dir=str(tmp_path / "ck"),
        episode_ids=[{"rollout_id": "nc", "attempt": 0}],
    )
    assert committed.json()["episode_ids"] == ["nc"]
    await control(http, "resume", checkpoint_id="ck-nc")
    reply = await call
    assert reply.status_code == 200
    assert tokens_of(reply.json()) == tokens_of(expected)
    assert servers.state.generated_total == ANSWER_TOKENS  # frozen, then resumed: every token generated once
    assert not servers.state.paused


async def test_a_call_whose_digest_differs_is_generated_from_scratch_and_the_cut_waits_for_its_own(
    servers: CutServers, tmp_path: Path
) -> None:
    expected = await reference(servers, "dm")
    first, http = servers.build(return_token_id_information=True)
    servers.state.pause_at = ("(dm)", 40)
    call = await start_call(http, "dm", "dm")
    await _until(lambda: servers.state.paused, "40 tokens generated")
    await control(http, "prepare", checkpoint_id="ck-dm")
    await control(
        http,
        "commit",
        checkpoint_id="ck-dm",
        checkpoint_dir=str(tmp_path / "ck"),
        episode_ids=[{"rollout_id": "dm", "attempt": 0}],
    )
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    await _until(lambda: servers.state.abandoned_total == 1, "the backend to see the stream dropped")
    await first.control.aclose()
    fresh, http2 = servers.build(return_token_id_information=True)
    restore = {"checkpoint_dir": str(tmp_path / "ck"), "episode_ids": [{"rollout_id": "dm", "attempt": 0}]}
    assert (await control(http2, "restore", checkpoint_id="rs-dm", **restore)).status_code == 200
    await control(http2, "resume", checkpoint_id="rs-dm")

    other = final_request(conversation("dm"))
    other["input"][0]["content"] += " (asked differently)"
    before = servers.state.generated_total
    reply = await http2.post(path_of("dm-a1"), json=other)
    assert reply.status_code == 200
    assert servers.state.generated_total - before == ANSWER_TOKENS  # from scratch: never spliced onto the cut
    status = (await fresh.status())["generation_cuts"]
    assert status["mismatched_total"] == 1 and status["continued_total"] == 0 and status["restored_pending"] == 1
    again = await http2.post(path_of("dm-a1"), json=final_request(conversation("dm")))
    assert tokens_of(again.json()) == tokens_of(expected)
    assert (await fresh.status())["generation_cuts"]["continued_total"] == 1


async def test_a_constrained_call_is_never_cut(servers: CutServers, tmp_path: Path) -> None:
    built, http = servers.build(return_token_id_information=True)
    servers.state.tokens_per_second = RATE
    body = {**final_request(conversation("tc")), "tool_choice": "required"}
    servers.state.pause_at = ("(tc)", 20)
    call = asyncio.ensure_future(http.post(path_of("tc"), json=body))
    await _until(lambda: servers.state.paused, "20 tokens generated")
    assert (await control(http, "prepare", checkpoint_id="ck-tc")).json()["phase"] == "prepared"
    assert servers.state.pauses_total == 1  # nothing cuttable runs: the model server froze nothing
    committed = await control(
        http,
        "commit",
        checkpoint_id="ck-tc",
        checkpoint_dir=str(tmp_path / "ck"),
        episode_ids=[{"rollout_id": "tc", "attempt": 0}],
    )
    assert committed.json()["episode_ids"] == []  # no cut: after a crash the call is generated again
    await control(http, "resume", checkpoint_id="ck-tc")
    servers.state.resume()
    assert (await call).status_code == 200
    status = (await built.status())["generation_cuts"]
    assert status["never_cut_total"] == {"constrained_tool_choice": 1} and status["streamed_total"] == 0
    assert "constrained_tool_choice" in status["never_cut"]


async def test_a_hung_freeze_does_not_delay_prepared_past_its_share_of_the_deadline(
    servers: CutServers, tmp_path: Path
) -> None:
    built, http = servers.build(return_token_id_information=True)
    servers.state.tokens_per_second = RATE
    servers.state.pause_at = ("(hg)", 20)
    call = asyncio.ensure_future(http.post(path_of("hg"), json=final_request(conversation("hg"))))
    await _until(lambda: servers.state.paused, "20 tokens generated")
    servers.state.pause_hangs = True
    window = 12.0
    started = time.monotonic()
    prepared = (await control(http, "prepare", seconds=window, checkpoint_id="ck-hg")).json()
    elapsed = time.monotonic() - started
    assert prepared["phase"] == "prepared" and prepared["report"]["ready"], prepared
    # Its share is a quarter of the time left: prepared well before the deadline, the rest left to later stages.
    assert elapsed < window * 0.25 + 2.0, elapsed
    freeze = (await built.status())["generation_cuts"]["freeze_worker"]
    assert freeze["timeouts_total"] == 1
    committed = await control(
        http,
        "commit",
        checkpoint_id="ck-hg",
        checkpoint_dir=str(tmp_path / "ck"),
        episode_ids=[{"rollout_id": "hg", "attempt": 0}],
    )
    assert committed.json()["episode_ids"] == ["hg"]  # the cut is taken where the stream stands
    await control(http, "resume", checkpoint_id="ck-hg")
    await _until(lambda: not servers.state.paused, "the worker resumed")
    assert (await call).status_code == 200
    assert servers.state.generated_total == ANSWER_TOKENS


async def _until(condition: Any, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)  # wait-ok: polling interval of a bounded condition wait


class _BlocksWithoutWaitReady:
    """A plugin on the model server with a blocker and no ``wait_ready``: readiness must be asked again."""

    blocked = True

    @hookimpl
    def ready(self, checkpoint_id: str | None) -> Readiness:
        return Readiness(blockers=["other"] if self.blocked else [])


async def test_the_model_participant_never_stalls_another_plugins_readiness(tmp_path: Path) -> None:
    from control_support import close_harness, make_harness
    from nemo_gym_checkpoint_plugin.builtin_participants.model.calls import ModelCalls

    other = _BlocksWithoutWaitReady()
    harness = await make_harness(tmp_path, extra_plugins=(ModelCalls(), other))
    try:
        prepare = asyncio.ensure_future(harness.call("prepare", checkpoint_id="c1", deadline_ts=time.time() + 30))
        await _until(lambda: harness.plane.phase == "preparing", "preparing")
        other.blocked = False
        assert (await asyncio.wait_for(prepare, 10))["phase"] == "prepared"
    finally:
        await close_harness(harness)
