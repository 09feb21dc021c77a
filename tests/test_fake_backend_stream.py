"""The fake backend speaks the vLLM fields generation cuts rely on: streamed chat, token-id completions, pause.

Each test drives the backend's app in process (httpx ASGI); answers are compared with the whole
(non-streamed) answer of the same request, which is what a streamed or continued one must equal.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from nemo_gym_checkpoint_plugin.testing.fake_backend import FakeBackendState, create_app
from nemo_gym_checkpoint_plugin.testing.harness import wait_until_async

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
ASK = {"logprobs": True, "return_tokens_as_token_ids": True, "return_token_ids": True}


def turn(user: str, *, tool_result: bool = True) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": user}]
    if tool_result:
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
        ]
    return {"model": "fake-model", "messages": messages, "tools": TOOLS}


def events(text: str) -> list[Any]:
    found = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            found.append(data if data == "[DONE]" else json.loads(data))
    return found


@pytest.fixture
def state() -> FakeBackendState:
    return FakeBackendState()


@pytest.fixture
async def client(state: FakeBackendState) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://fake", timeout=30) as c:
        yield c


async def whole(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    reply = await client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.parametrize("tool_result", [False, True], ids=["tool-call", "final-answer"])
async def test_a_streamed_answer_carries_the_whole_answer_token_by_token(
    client: httpx.AsyncClient, tool_result: bool
) -> None:
    body = {**turn("stream me [answer_words=5]", tool_result=tool_result), **ASK}
    answer = (await whole(client, body))["choices"][0]
    reply = await client.post(
        "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert reply.headers["content-type"].startswith("text/event-stream")
    chunks = events(reply.text)
    assert (
        chunks[-1] == "[DONE]"
        and chunks[-2]["choices"] == []
        and chunks[-2]["usage"]["completion_tokens"] == len(answer["token_ids"])
    )
    first, tokens = chunks[0], chunks[1:-2]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["prompt_token_ids"] == (await whole(client, body))["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in tokens)  # only in the first chunk
    assert [t for c in tokens for t in c["choices"][0]["token_ids"]] == answer["token_ids"]  # one id per chunk
    assert [e for c in tokens for e in c["choices"][0]["logprobs"]["content"]] == answer["logprobs"]["content"]
    deltas = [c["choices"][0]["delta"] for c in tokens]
    content = "".join(d.get("content", "") for d in deltas) or None
    calls = [call for d in deltas for call in d.get("tool_calls", ())]
    assert content == answer["message"]["content"]
    assert [{k: v for k, v in c.items() if k != "index"} for c in calls] == answer["message"].get("tool_calls", [])
    assert tokens[-1]["choices"][0]["finish_reason"] == answer["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in tokens[:-1])


async def test_a_token_id_prompt_continues_the_answer_from_a_partial_answer(client: httpx.AsyncClient) -> None:
    body = {**turn("continue me [answer_words=20]"), **ASK}
    answer = await whole(client, body)
    choice = answer["choices"][0]
    generated, cut = choice["token_ids"], 9
    prompt = answer["prompt_token_ids"] + generated[:cut]
    request = {
        "model": "fake-model",
        "prompt": prompt,
        "max_tokens": 100,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }
    rest = (await client.post("/v1/completions", json=request)).json()["choices"][0]
    assert rest["token_ids"] == generated[cut:] and rest["prompt_token_ids"] == prompt
    # Each remaining token has the logprob it has at its place in the whole answer.
    assert rest["logprobs"]["token_logprobs"] == [e["logprob"] for e in choice["logprobs"]["content"][cut:]]
    assert rest["logprobs"]["tokens"] == [f"token_id:{t}" for t in generated[cut:]]
    assert rest["finish_reason"] == "stop"
    prefix = (await client.post("/detokenize", json={"tokens": generated[:cut]})).json()["prompt"]
    assert prefix + rest["text"] == choice["message"]["content"]

    streamed = events((await client.post("/v1/completions", json={**request, "stream": True})).text)
    assert streamed[-1] == "[DONE]"
    pieces = [c["choices"][0] for c in streamed[:-1]]
    assert [t for p in pieces for t in p["token_ids"]] == generated[cut:]
    assert "".join(p["text"] for p in pieces) == rest["text"]
    assert pieces[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in p for p in pieces[1:])
    assert pieces[-1]["finish_reason"] == "stop"

    capped = (await client.post("/v1/completions", json={**request, "max_tokens": 3})).json()["choices"][0]
    assert capped["token_ids"] == generated[cut : cut + 3] and capped["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("prompt", "why"),
    [("a string prompt", "token ids only"), ([10**12], "generation prompt"), ([3, 987654321, 11, 10], "vocabulary")],
)
async def test_a_prompt_it_cannot_decode_is_a_400(client: httpx.AsyncClient, prompt: Any, why: str) -> None:
    reply = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5})
    assert reply.status_code == 400 and why in reply.json()["error"]["message"]


async def test_a_partial_answer_that_is_not_its_own_is_refused(client: httpx.AsyncClient) -> None:
    answer = await whole(client, {**turn("mine"), **ASK})
    wrong = answer["prompt_token_ids"] + answer["choices"][0]["token_ids"][1:3]
    reply = await client.post("/v1/completions", json={"prompt": wrong, "max_tokens": 5})
    assert reply.status_code == 400 and "not the start" in reply.json()["error"]["message"]


async def test_tokens_are_counted_per_conversation_as_they_are_generated(
    client: httpx.AsyncClient, state: FakeBackendState
) -> None:
    answer = await whole(client, {**turn("count me [answer_words=30]"), **ASK})
    generated = answer["choices"][0]["token_ids"]
    request = {"prompt": answer["prompt_token_ids"] + generated[:12], "max_tokens": 100}
    await client.post("/v1/completions", json=request)
    counted = (await client.get("/_fake/generated")).json()
    # The whole answer once, then only what followed the 12 tokens the continuation started from.
    assert counted["generated"] == {"count me [answer_words=30]": len(generated) + len(generated) - 12}
    assert counted["generated_total"] == state.generated_total == 2 * len(generated) - 12


async def test_pause_keep_freezes_a_stream_in_place_and_resume_lets_it_finish(
    client: httpx.AsyncClient, state: FakeBackendState
) -> None:
    await client.post("/_fake/rate", json={"tokens_per_second": 400})
    body = {**turn("freeze me [answer_words=200]"), "stream": True}
    streaming = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
    await wait_until_async(_generated_at_least(client, 20), 20, "the stream to generate")
    assert (await client.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
    assert (await client.get("/is_paused")).json() == {"is_paused": True}
    frozen = (await client.get("/_fake/generated")).json()["generated_total"]
    other = asyncio.ensure_future(client.post("/v1/chat/completions", json={**turn("queued"), "stream": False}))
    for _ in range(50):
        await asyncio.sleep(0)  # wait-ok: yields to the loop; a frozen generation must not advance meanwhile
    assert state.generated_total == frozen and not streaming.done() and not other.done()
    await client.post("/resume")
    reply = await streaming
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in events(reply.text)[1:-1]).endswith("word199")
    assert (await other).status_code == 200
    assert (await client.post("/pause", params={"mode": "abort"})).status_code == 400


async def test_without_dev_routes_pause_is_not_served() -> None:
    transport = httpx.ASGITransport(app=create_app(dev_routes=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
        assert (await client.post("/pause", params={"mode": "keep"})).status_code == 404
        assert (await client.get("/is_paused")).status_code == 404


async def test_with_a_reasoning_parser_reasoning_is_split_off_streamed_and_whole() -> None:
    transport = httpx.ASGITransport(app=create_app(reasoning_parser=True))
    async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
        body = turn("think first [reasoning_words=4]")
        message = (await whole(client, body))["choices"][0]["message"]
        assert message["reasoning"] == " thought0 thought1 thought2 thought3 "
        assert message["content"] == " It is cold in San Francisco today."
        chunks = events((await client.post("/v1/chat/completions", json={**body, "stream": True})).text)[1:-1]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
        assert "".join(d.get("content", "") for d in deltas) == message["content"]
    plain = httpx.ASGITransport(app=create_app())
    async with httpx.AsyncClient(transport=plain, base_url="http://fake") as client:
        content = (await whole(client, body))["choices"][0]["message"]["content"]
        assert (
            content.startswith("<think> thought0")
            and "reasoning" not in (await whole(client, body))["choices"][0]["message"]
        )


def _generated_at_least(client: httpx.AsyncClient, count: int) -> Any:
    async def check() -> bool:
        return (await client.get("/_fake/generated")).json()["generated_total"] >= count

    return check


def test_the_numbered_words_of_long_answers_never_share_a_token_id() -> None:
    from nemo_gym_checkpoint_plugin.testing.fake_tokens import Vocabulary

    vocabulary = Vocabulary()
    words = [f"{stem}{i}" for stem in ("word", "thought") for i in range(100_000)] + ["word007", "other"]
    tokens = [vocabulary.token(word) for word in words]
    assert len(set(tokens)) == len(words)
    assert vocabulary.text(tokens) == " ".join(words)
    assert tokens == [Vocabulary().token(word) for word in words]  # a function of the word alone


async def test_pause_at_freezes_the_backend_right_after_the_named_token(
    client: httpx.AsyncClient, state: FakeBackendState
) -> None:
    assert (await client.post("/_fake/pause_at", json={"match": "(stop here)", "tokens": 0})).status_code == 400
    await client.post("/_fake/pause_at", json={"match": "(stop here)", "tokens": 25})
    await whole(client, turn("another conversation [answer_words=40]"))  # not the one named: runs through
    assert not state.paused
    call = asyncio.ensure_future(client.post("/v1/chat/completions", json=turn("(stop here) [answer_words=40]")))
    await wait_until_async(_paused(client), 20, "the backend paused")
    assert state.generated["(stop here) [answer_words=40]"] == 25 and not call.done()
    await client.post("/resume")
    assert (await call).status_code == 200
    assert state.generated["(stop here) [answer_words=40]"] == 48 and state.pause_at is None


def _paused(client: httpx.AsyncClient) -> Any:
    async def check() -> bool:
        return (await client.get("/is_paused")).json()["is_paused"]

    return check
