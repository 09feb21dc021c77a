"""The fake inference backend: deterministic OpenAI chat answers, held calls, per-step counters."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from nemo_gym_checkpoint_plugin.testing import fake_backend
from nemo_gym_checkpoint_plugin.testing.deployment import FAKE_BACKEND_MODULE
from nemo_gym_checkpoint_plugin.testing.harness import free_port_base, wait_until_async

FINAL_ANSWER = fake_backend.FINAL_ANSWER
create_app = fake_backend.create_app

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def first_turn(user: str) -> dict:
    return {
        "model": "fake-model",
        "messages": [{"role": "system", "content": "be helpful"}, {"role": "user", "content": user}],
        "tools": TOOLS,
    }


def after_tool(user: str, call_id: str) -> dict:
    body = first_turn(user)
    body["messages"] += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "cold"},
    ]
    return body


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://fake") as c:
        yield c


async def test_models_lists_the_configured_model(client: httpx.AsyncClient) -> None:
    reply = await client.get("/v1/models")
    assert [m["id"] for m in reply.json()["data"]] == ["fake-model"]


async def test_a_tool_call_first_then_the_final_answer_once_a_tool_message_is_present(client) -> None:
    first = (await client.post("/v1/chat/completions", json=first_turn("sf?"))).json()
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "San Francisco"}

    second = (await client.post("/v1/chat/completions", json=after_tool("sf?", call["id"]))).json()
    assert second["choices"][0]["finish_reason"] == "stop"
    assert second["choices"][0]["message"] == {"role": "assistant", "content": FINAL_ANSWER}


async def test_answers_are_deterministic_and_a_repeated_step_is_reported(client: httpx.AsyncClient) -> None:
    one = (await client.post("/v1/chat/completions", json=first_turn("rollout A"))).json()
    two = (await client.post("/v1/chat/completions", json=first_turn("rollout A"))).json()
    assert one["choices"] == two["choices"]
    await client.post("/v1/chat/completions", json=first_turn("rollout B"))
    stats = (await client.get("/_fake/stats")).json()
    assert stats["calls"] == {"rollout A": {"0": 2}, "rollout B": {"0": 1}}
    assert stats["repeated"] == [{"conversation": "rollout A", "step": 0, "count": 2}]
    assert stats["calls_total"] == stats["completed_total"] == 3


async def test_a_held_call_waits_until_released_and_the_rule_is_used_up(client: httpx.AsyncClient) -> None:
    await client.post("/_fake/hold", json={"match": "slow", "count": 1, "step": 0})
    held = asyncio.create_task(client.post("/v1/chat/completions", json=first_turn("a slow rollout")))

    async def held_now() -> dict | None:
        stats = (await client.get("/_fake/stats")).json()
        return stats if stats["held"] == 1 else None

    stats = await wait_until_async(held_now, timeout=10, what="one held call")
    assert stats["held_calls"] == [{"conversation": "a slow rollout", "step": 0}]
    assert stats["completed"] == {}
    assert not held.done()
    # Another conversation is not held, and the used-up rule does not hold the next matching call.
    assert (await client.post("/v1/chat/completions", json=first_turn("a fast rollout"))).status_code == 200

    assert (await client.post("/_fake/release", json={})).json() == {"released": 1, "rules_dropped": 1}
    assert (await asyncio.wait_for(held, timeout=10)).status_code == 200
    again = await asyncio.wait_for(client.post("/v1/chat/completions", json=first_turn("a slow rollout")), 10)
    assert again.status_code == 200
    assert (await client.get("/_fake/stats")).json()["held"] == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", b"not json"),
        ("/v1/chat/completions", b'{"messages": "nope"}'),
        ("/_fake/hold", b'{"count": 0}'),
        ("/_fake/hold", b'{"match": 3}'),
        ("/_fake/hold", b"[1]"),
        ("/_fake/release", b'{"match": 1}'),
    ],
)
async def test_bad_input_is_a_400_never_a_500(client: httpx.AsyncClient, path: str, body: bytes) -> None:
    reply = await client.post(path, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400


@pytest.mark.slow
async def test_a_held_call_whose_client_goes_away_is_abandoned(tmp_path: Path) -> None:
    port = free_port_base(span=1)
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "fake.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", FAKE_BACKEND_MODULE, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=10) as control:

            async def stats_when(predicate) -> dict | None:
                try:
                    stats = (await control.get("/_fake/stats")).json()
                except httpx.TransportError:
                    return None
                return stats if predicate(stats) else None

            await wait_until_async(lambda: stats_when(lambda s: True), timeout=30, what="the backend to serve")
            await control.post("/_fake/hold", json={"match": "gone", "count": 1})
            async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as caller:
                call = asyncio.create_task(caller.post("/v1/chat/completions", json=first_turn("gone soon")))
                await wait_until_async(lambda: stats_when(lambda s: s["held"] == 1), timeout=10, what="a held call")
                call.cancel()  # closes the connection, as a killed caller would
                with pytest.raises(asyncio.CancelledError):
                    await call
            stats = await wait_until_async(
                lambda: stats_when(lambda s: s["abandoned_total"] == 1), timeout=10, what="the call to be abandoned"
            )
            assert stats["held"] == 0
            assert stats["completed_total"] == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.slow
async def test_a_generating_call_whose_client_goes_away_is_abandoned(tmp_path: Path) -> None:
    port = free_port_base(span=1)
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "fake.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", FAKE_BACKEND_MODULE, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=10) as control:

            async def stats_when(predicate) -> dict | None:
                try:
                    stats = (await control.get("/_fake/stats")).json()
                except httpx.TransportError:
                    return None
                return stats if predicate(stats) else None

            await wait_until_async(lambda: stats_when(lambda s: True), timeout=30, what="the backend to serve")
            assert (await control.post("/_fake/delay", json={"seconds": 600})).json() == {"delay_seconds": 600.0}
            assert (await control.post("/_fake/delay", json={"seconds": -1})).status_code == 400
            async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as caller:
                call = asyncio.create_task(caller.post("/v1/chat/completions", json=first_turn("slow")))
                await wait_until_async(lambda: stats_when(lambda s: s["generating"] == 1), 10, "a generating call")
                call.cancel()  # the caller drops the request mid-generation
                with pytest.raises(asyncio.CancelledError):
                    await call
            stats = await wait_until_async(
                lambda: stats_when(lambda s: s["abandoned_total"] == 1), timeout=10, what="the call to be abandoned"
            )
            assert stats["generating"] == 0 and stats["completed_total"] == 0
            await control.post("/_fake/reset")
            assert (await control.get("/_fake/stats")).json()["delay_seconds"] == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)


async def test_token_ids_when_asked_chain_across_the_calls_of_a_turn(client: httpx.AsyncClient) -> None:
    plain = (await client.post("/v1/chat/completions", json=first_turn("tokens"))).json()
    assert "prompt_token_ids" not in plain and plain["choices"][0]["logprobs"] is None
    asked = {"logprobs": True, "return_tokens_as_token_ids": True, "return_token_ids": True}
    first = (await client.post("/v1/chat/completions", json={**first_turn("tokens"), **asked})).json()
    choice = first["choices"][0]
    generated = choice["token_ids"]
    assert [f"token_id:{t}" for t in generated] == [e["token"] for e in choice["logprobs"]["content"]]
    call = choice["message"]["tool_calls"][0]
    second_body = after_tool("tokens", call["id"])
    second_body["messages"][2]["tool_calls"][0]["function"] = call["function"]
    second = (await client.post("/v1/chat/completions", json={**second_body, **asked})).json()
    # The first call's prompt and generation are a prefix of the next call's prompt, as a chat template makes them.
    chained = first["prompt_token_ids"] + generated
    assert second["prompt_token_ids"][: len(chained)] == chained
    # /tokenize renders the same prompt (Gym asks it when an answer carries no prompt ids), as vLLM's does.
    tokenized = (await client.post("/tokenize", json=second_body)).json()
    assert tokenized["tokens"] == second["prompt_token_ids"] and tokenized["count"] == len(tokenized["tokens"])


async def test_token_ids_and_logprobs_only_when_asked_as_vllm_answers(client: httpx.AsyncClient) -> None:
    logprobs_only = (await client.post("/v1/chat/completions", json={**first_turn("lp"), "logprobs": True})).json()
    choice = logprobs_only["choices"][0]
    assert "prompt_token_ids" not in logprobs_only and "token_ids" not in choice
    # Without return_tokens_as_token_ids a logprob names its token's text.
    entries = choice["logprobs"]["content"]
    assert (
        "".join(e["token"] for e in entries)
        == "<tool_call> "
        + json.dumps(
            {
                "id": choice["message"]["tool_calls"][0]["id"],
                "name": "get_weather",
                "arguments": {"city": "San Francisco"},
            }
        )
        + " </tool_call>"
    )
    assert all(e["bytes"] == list(e["token"].encode()) and e["top_logprobs"] == [] for e in entries)


async def test_a_multi_call_turn_calls_its_tool_n_times_then_answers(client: httpx.AsyncClient) -> None:
    user = "weather please [tool_rounds=3]"
    body = first_turn(user)
    for step in range(3):
        reply = (await client.post("/v1/chat/completions", json=body)).json()
        (choice,) = reply["choices"]
        assert choice["finish_reason"] == "tool_calls", step
        call = choice["message"]["tool_calls"][0]
        body["messages"] += [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "cold"}]
    final = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert final["finish_reason"] == "stop" and final["message"]["content"] == FINAL_ANSWER
    stats = (await client.get("/_fake/stats")).json()
    assert stats["completed"][user] == {"0": 1, "1": 1, "2": 1, "3": 1}


async def test_brief_stats_are_the_counters_alone(client: httpx.AsyncClient) -> None:
    await client.post("/_fake/hold", json={"match": "brief", "count": 1})
    held = asyncio.create_task(client.post("/v1/chat/completions", json=first_turn("brief one")))
    await client.post("/v1/chat/completions", json=first_turn("another"))
    brief = await wait_until_async(
        lambda: _json_when(client, "/_fake/stats?brief=true", lambda s: s["held"] == 1), timeout=10, what="a held call"
    )
    assert brief == {"held": 1, "calls_total": 2, "completed_total": 1, "abandoned_total": 0}
    await client.post("/_fake/release", json={})
    assert (await held).status_code == 200
    assert (await client.get("/_fake/stats", params={"brief": "true"})).json()["completed_total"] == 2


async def _json_when(client: httpx.AsyncClient, path: str, predicate) -> dict | None:
    body = (await client.get(path)).json()
    return body if predicate(body) else None
