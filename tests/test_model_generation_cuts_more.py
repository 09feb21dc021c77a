"""Generation cuts where the whole text must be parsed again, cut twice, or dropped.

In process, as ``test_model_generation_cuts.py``: a cut inside a tool-call block, a cut inside the
reasoning of a reasoning model (the worker's reasoning parser on, Gym's ``uses_reasoning_parser``),
a continued call checkpointed and crashed again (the newer cut is exported and continued), and a
restored cut dropped by a retire or by a commit whose scope leaves its episode out.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from cut_support import CutServers, control, final_request, first_request, path_of

HERMES = {"tool_call_parser": "hermes"}


async def _servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **options: Any) -> CutServers:
    model = {"uses_reasoning_parser": True} if options.get("reasoning_parser") else None
    servers = CutServers(tmp_path, monkeypatch, cuts=HERMES, model=model)
    await servers.start(**options)
    return servers


@pytest.fixture
async def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[CutServers]:
    servers = await _servers(tmp_path, monkeypatch)
    yield servers
    await servers.aclose()


@pytest.fixture
async def thinking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[CutServers]:
    servers = await _servers(tmp_path, monkeypatch, reasoning_parser=True)
    yield servers
    await servers.aclose()


def tokens_of(reply: dict[str, Any]) -> list[tuple[Any, ...]]:
    found = []
    for item in reply["output"]:
        text = "".join(part.get("text", "") for part in item.get("content") or [])
        summary = "".join(part.get("text", "") for part in item.get("summary") or [])
        found.append(
            (
                item["type"],
                text,
                summary,
                item.get("name"),
                item.get("arguments"),
                item.get("call_id"),
                item.get("generation_token_ids"),
                item.get("generation_log_probs"),
            )
        )
    return found


async def reference(servers: CutServers, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The uninterrupted answer to ``body`` and how many tokens it takes; then clean counters."""
    _, http = servers.build(return_token_id_information=True)
    reply = await http.post(path_of("reference"), json=body)
    assert reply.status_code == 200, reply.text
    generated = servers.state.generated_total
    servers.state.reset()
    return reply.json(), generated


async def crash(servers: CutServers, built: Any, call: asyncio.Future[Any], abandoned: int) -> None:
    """The old process's call dropped (the backend sees it) and its control plane gone."""
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    await _until(lambda: servers.state.abandoned_total >= abandoned, "the backend to see the stream dropped")
    await built.control.aclose()


async def checkpoint(http: Any, name: str, directory: Path, rollout: str, attempt: int) -> dict[str, Any]:
    assert (await control(http, "prepare", checkpoint_id=name)).json()["phase"] == "prepared"
    committed = await control(
        http,
        "commit",
        checkpoint_id=name,
        checkpoint_dir=str(directory),
        episode_ids=[{"rollout_id": rollout, "attempt": attempt}],
    )
    assert committed.status_code == 200, committed.text
    return committed.json()


async def restored(servers: CutServers, name: str, directory: Path, rollout: str, attempt: int) -> tuple[Any, Any]:
    built, http = servers.build(return_token_id_information=True)
    restore = {"checkpoint_dir": str(directory), "episode_ids": [{"rollout_id": rollout, "attempt": attempt}]}
    reply = await control(http, "restore", checkpoint_id=name, **restore)
    assert reply.status_code == 200, reply.text
    await control(http, "resume", checkpoint_id=name)
    return built, http


def spy(server: Any) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Every (request, answer) the server's worker client gives Gym: the worker-level answer of each call."""
    seen: list[tuple[dict[str, Any], dict[str, Any]]] = []
    resolve = server._resolve_client

    class Spy:
        def __init__(self, client: Any) -> None:
            self.client = client

        def __getattr__(self, name: str) -> Any:
            return getattr(self.client, name)

        async def create_chat_completion(self, **body: Any) -> Any:
            answer = await self.client.create_chat_completion(**copy.deepcopy(body))
            seen.append((body, copy.deepcopy(answer)))  # Gym changes the answer in place once it has it
            return answer

    server._resolve_client = lambda request: Spy(resolve(request))
    return seen


async def same_as_the_worker_answers(servers: CutServers, body: dict[str, Any], answer: dict[str, Any]) -> None:
    """``answer`` is what the worker itself answers ``body`` without streaming (its creation time aside)."""
    import httpx

    servers.state.tokens_per_second = 0.0
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{servers.port}", trust_env=False) as http:
        direct = (await http.post("/v1/chat/completions", json=body)).json()
    assert {**answer, "created": None} == {**direct, "created": None}


async def cut_and_continue(servers: CutServers, tmp_path: Path, body: dict[str, Any], after: int) -> dict[str, Any]:
    """Generate ``body`` on ``r``, checkpoint after ``after`` tokens, crash, continue as ``r-a1``.

    The continued answer must equal an uninterrupted one as Gym returns it and, at the worker level, as
    the worker itself answers the same request.
    """
    expected, total = await reference(servers, body)
    servers.state.tokens_per_second = 100.0
    servers.state.pause_at = ("", after)
    built, http = servers.build(return_token_id_information=True)
    call = asyncio.ensure_future(http.post(path_of("r"), json=body))
    await _until(lambda: servers.state.paused, f"{after} tokens generated")
    assert (await checkpoint(http, "ck", tmp_path / "ck", "r", 0))["episode_ids"] == ["r"]
    cut = servers.state.generated_total
    assert cut == after
    await crash(servers, built, call, 1)
    fresh, http2 = await restored(servers, "rs", tmp_path / "ck", "r", 0)
    answers = spy(fresh.server)
    reply = await http2.post(path_of("r-a1"), json=body)
    assert reply.status_code == 200, reply.text
    assert servers.state.generated_total == total, "only the remainder after the cut is generated"
    assert 0 < cut < total
    assert tokens_of(reply.json()) == tokens_of(expected)
    ((sent, answer),) = answers
    await same_as_the_worker_answers(servers, sent, answer)
    return reply.json()


async def test_a_cut_inside_a_tool_call_block_continues_into_the_same_tool_call(
    servers: CutServers, tmp_path: Path
) -> None:
    reply = await cut_and_continue(servers, tmp_path, first_request("call a tool (tool)"), after=4)
    (call,) = [item for item in reply["output"] if item["type"] == "function_call"]
    assert call["name"] == "get_weather" and call["arguments"] == '{"city": "San Francisco"}'


async def test_a_cut_inside_the_reasoning_continues_and_parses_reasoning_and_answer_as_a_whole(
    thinking: CutServers, tmp_path: Path
) -> None:
    body = final_request("think first (think) [reasoning_words=80]")
    reply = await cut_and_continue(thinking, tmp_path, body, after=30)
    (reasoning,) = [item for item in reply["output"] if item["type"] == "reasoning"]
    (message,) = [item for item in reply["output"] if item["type"] == "message"]
    # The reasoning (cut in its middle) is one reasoning item, the answer after </think> the message.
    assert "".join(part["text"] for part in reasoning["summary"]).split() == [f"thought{i}" for i in range(80)]
    assert "".join(part["text"] for part in message["content"]) == " It is cold in San Francisco today."


async def test_a_continued_call_checkpointed_again_exports_the_newer_cut(servers: CutServers, tmp_path: Path) -> None:
    body = final_request("twice (twice) [answer_words=300]")
    expected, total = await reference(servers, body)
    servers.state.tokens_per_second = 600.0
    servers.state.pause_at = ("", 60)
    built, http = servers.build(return_token_id_information=True)
    call = asyncio.ensure_future(http.post(path_of("r"), json=body))
    await _until(lambda: servers.state.paused, "60 tokens generated")
    await checkpoint(http, "ck-1", tmp_path / "ck-1", "r", 0)
    first_cut = servers.state.generated_total
    await crash(servers, built, call, 1)

    servers.state.pause_at = ("", first_cut + 100)
    built2, http2 = await restored(servers, "rs-1", tmp_path / "ck-1", "r", 0)
    continuing = asyncio.ensure_future(http2.post(path_of("r-a1"), json=body))
    await _until(lambda: servers.state.paused, "100 more tokens generated")
    await checkpoint(http2, "ck-2", tmp_path / "ck-2", "r", 1)
    second_cut = servers.state.generated_total
    assert (first_cut, second_cut) == (60, 160)
    await crash(servers, built2, continuing, 2)

    built3, http3 = await restored(servers, "rs-2", tmp_path / "ck-2", "r", 1)
    reply = await http3.post(path_of("r-a2"), json=body)
    assert tokens_of(reply.json()) == tokens_of(expected)
    assert servers.state.generated_total == total  # each token once, across two crashes
    assert (await built3.status())["generation_cuts"]["tokens_continued_total"] == second_cut


async def test_a_restored_cut_goes_with_a_retire_or_a_commit_that_leaves_its_episode_out(
    servers: CutServers, tmp_path: Path
) -> None:
    servers.state.tokens_per_second = 600.0
    servers.state.pause_at = ("", 30)
    built, http = servers.build(return_token_id_information=True)
    call = asyncio.ensure_future(http.post(path_of("r"), json=final_request("dropped (drop) [answer_words=300]")))
    await _until(lambda: servers.state.paused, "30 tokens generated")
    await checkpoint(http, "ck", tmp_path / "ck", "r", 0)
    await crash(servers, built, call, 1)

    for way in ("retire", "commit"):
        fresh, http2 = servers.build(return_token_id_information=True)
        restore = {"checkpoint_dir": str(tmp_path / "ck"), "episode_ids": [{"rollout_id": "r", "attempt": 0}]}
        assert (await control(http2, "restore", checkpoint_id=f"rs-{way}", **restore)).status_code == 200
        assert (await fresh.status())["generation_cuts"]["restored_pending"] == 1
        await control(http2, "resume", checkpoint_id=f"rs-{way}")
        if way == "retire":
            retired = await control(
                http2, "retire", checkpoint_id="retire-1", episode_ids=[{"rollout_id": "r", "attempt": 1}]
            )
            assert retired.status_code == 200, retired.text
        else:
            await control(http2, "prepare", checkpoint_id="ck-empty")
            empty = await control(
                http2, "commit", checkpoint_id="ck-empty", checkpoint_dir=str(tmp_path / "empty"), episode_ids=[]
            )
            assert empty.json()["episode_ids"] == []
            await control(http2, "resume", checkpoint_id="ck-empty")
        assert (await fresh.status())["generation_cuts"]["restored_pending"] == 0, way
        await fresh.control.aclose()


async def _until(condition: Any, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)  # wait-ok: polling interval of a bounded condition wait
