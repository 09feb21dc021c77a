"""A scripted policy model and tool server for in-process Simple Agent turns (real HTTP on 127.0.0.1).

``ScriptedPeers`` is one uvicorn server, started in the test's event loop, that answers
the two kinds of call a Simple Agent turn makes:

- ``POST [/ng-rollout/<key>]/v1/responses`` (the policy model server's Responses API): a
  **conversation** is the first user text; its **step** is the number of function calls
  already in the input. While fewer than ``ROUNDS`` tool results are in the input the
  answer is one call of ``get_weather``, then a final message. Every output item carries
  token ids derived from its step only (``generation_token_ids == [1000 + step]``), so a
  turn's result tells each call's tokens apart and two conversations compare equal.
- ``POST [/ng-rollout/<key>]/get_weather`` (the episode's direct tool access): answers a
  constant text and counts the call per conversation key of its URL.

``hold(conversation, step)`` holds the next model call at that step until ``release``;
``calls``/``completed`` count model calls per (conversation, step), ``tools`` tool calls
per rollout key. A held call whose client goes away counts as ``abandoned``.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

__all__ = ["ROUNDS", "ScriptedPeers"]

ROUNDS = 2


def _conversation(items: list[Any]) -> tuple[str, int]:
    users = [i for i in items if isinstance(i, dict) and i.get("role") == "user"]
    content = users[0].get("content") if users else ""
    text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content or [])
    return text, sum(1 for i in items if isinstance(i, dict) and i.get("type") == "function_call")


def _answer(step: int, tool_results: int) -> dict[str, Any]:
    tokens = {"prompt_token_ids": [1, 2, step], "generation_token_ids": [1000 + step], "generation_log_probs": [-0.5]}
    if tool_results < ROUNDS:
        item = {
            "type": "function_call",
            "id": f"fc-{step}",
            "call_id": f"call-{step}",
            "name": "get_weather",
            "arguments": json.dumps({"city": "San Francisco"}),
            "status": "completed",
            **tokens,
        }
    else:
        item = {
            "type": "message",
            "id": f"msg-{step}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "cold", "annotations": []}],
            **tokens,
        }
    return {
        "id": f"resp-{step}",
        "created_at": 0,
        "model": "scripted",
        "object": "response",
        "output": [item],
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
    }


class ScriptedPeers:
    def __init__(self, port: int) -> None:
        self.port = port
        self.calls: Counter[tuple[str, int]] = Counter()
        self.completed: Counter[tuple[str, int]] = Counter()
        self.tools: Counter[str] = Counter()
        self.abandoned = 0
        self._holds: dict[tuple[str, int], asyncio.Event] = {}
        self.held: set[tuple[str, int]] = set()
        self.tool_gate: asyncio.Event | None = None
        self.tools_in_flight = 0
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[Any] | None = None

    def hold(self, conversation: str, step: int) -> None:
        self._holds[(conversation, step)] = asyncio.Event()

    def release(self, conversation: str, step: int) -> None:
        self._holds.pop((conversation, step)).set()

    def app(self) -> FastAPI:
        app = FastAPI()

        async def model(request: Request) -> JSONResponse:
            body = await request.json()
            conversation, step = _conversation(body["input"])
            self.calls[(conversation, step)] += 1
            gate = self._holds.get((conversation, step))
            if gate is not None:
                self.held.add((conversation, step))
                try:
                    while not gate.is_set():
                        try:
                            await asyncio.wait_for(gate.wait(), timeout=0.05)
                        except TimeoutError:
                            if await request.is_disconnected():
                                self.abandoned += 1
                                return JSONResponse({}, status_code=499)
                finally:
                    self.held.discard((conversation, step))
            self.completed[(conversation, step)] += 1
            results = sum(1 for i in body["input"] if isinstance(i, dict) and i.get("type") == "function_call_output")
            return JSONResponse(_answer(step, results))

        async def tool(request: Request, key: str = "unattributed") -> JSONResponse:
            self.tools[key] += 1
            self.tools_in_flight += 1
            try:
                if self.tool_gate is not None:
                    await self.tool_gate.wait()
            finally:
                self.tools_in_flight -= 1
            return JSONResponse({"city": "San Francisco", "weather_description": "cold"})

        app.post("/v1/responses")(model)
        app.post("/ng-rollout/{key}/v1/responses")(model)
        app.post("/get_weather")(tool)
        app.post("/ng-rollout/{key}/get_weather")(tool)
        return app

    async def start(self) -> None:
        config = uvicorn.Config(self.app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._task = asyncio.ensure_future(self._server.serve())
        async with asyncio.timeout(10):
            while not self._server.started:
                await asyncio.sleep(0.01)  # wait-ok: poll interval of a bounded wait for the server to start

    async def aclose(self) -> None:
        for gate in self._holds.values():
            gate.set()
        if self.tool_gate is not None:
            self.tool_gate.set()
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.wait_for(self._task, timeout=10)
