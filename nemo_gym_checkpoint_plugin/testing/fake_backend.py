"""A deterministic OpenAI-compatible fake inference backend that can hold calls.

Run it with ``python -m nemo_gym_checkpoint_plugin.testing.fake_backend --port N``; it stands
in for vLLM in the testing kit's deployment, the demo and ``serve``.

Gym's ``vllm_model`` server talks to it exactly as to vLLM: ``GET /v1/models`` and
``POST /v1/chat/completions`` (OpenAI chat format). The answer depends only on the
messages, so a rollout replayed after a crash gets the same answers:

- fewer ``tool`` messages than the turn's tool rounds and the request offers tools: one
  call of the first tool (``finish_reason: "tool_calls"``), with arguments filled from its
  JSON schema (``city`` is ``"San Francisco"``, other strings ``"x"``), which earns
  ``example_single_tool_call`` its reward 1.0. A turn has one tool round, or N when its
  conversation contains ``[tool_rounds=N]`` (a multi-call turn: tools called N times);
- otherwise: a final text answer (``finish_reason: "stop"``): one sentence, followed by N
  more words when the conversation contains ``[answer_words=N]`` (a long answer: its stream
  outlasts the socket buffers of a caller that stops reading).

A request asking for ``logprobs`` or ``return_tokens_as_token_ids`` (both sent by Gym's
``vllm_model`` with ``return_token_id_information: true``) also gets token ids
as vLLM returns them (``fake_tokens.py``: ``prompt_token_ids``, the choice's ``token_ids``
and ``token_id:<n>`` logprobs), chained across the calls of a turn.

A request carrying Gym's token-staging admission (``ng_capture``: ``token_id_capture`` with
``external_staging: true``) is staged as a vLLM worker with Gym's capture installed stages it
(``fake_staging.py``: the staged calls go to ``--staging-dir``, default ``$NG_FAKE_STAGING_DIR``
or ``./fake-staging``) and acknowledged with ``ng_commit_coords``.

A **conversation** is named by the text of its first ``user`` message (tests put the
rollout id in it); its **step** is the number of ``assistant`` messages already in the
request (0 for the first call of a turn, 1 after one tool round trip...).

Control routes (for tests; never part of a real backend):

- ``POST /_fake/hold {"match": "", "count": 1, "step": null}``: hold the next ``count``
  calls whose conversation contains ``match`` (and, when ``step`` is given, at that
  step). A held call answers only once released; while held it shows in stats.
- ``POST /_fake/release {"match": null}``: release every held call whose conversation
  contains ``match`` (all when null) and drop the hold rules made with that ``match``
  (all when null).
  Replies ``{"released": n, "rules_dropped": m}``.
- ``GET /_fake/stats?brief=true``: only the four counters below (``held``, ``calls_total``,
  ``completed_total``, ``abandoned_total``), cheap to poll at thousands of held calls.
- ``GET /_fake/stats``: ``held`` (count of calls waiting now), ``held_calls``, ``rules``,
  ``calls_total``, ``completed_total``, ``abandoned_total``, ``calls`` and ``completed``
  (``{conversation: {step: count}}``; arrivals and answers sent), ``repeated`` (every
  conversation/step that arrived more than once).
- ``POST /_fake/reset``: drop counters, rules, the delay, and release every held call.
- ``POST /_fake/delay {"seconds": 0}``: every call generates for that long before it
  answers (a held call after its release), like a real worker; ``generating`` in stats
  counts the calls inside that time now.

A held call whose client disconnects (its caller was killed) is dropped from ``held``
and counted in ``abandoned_total``, so a test can wait for a crash to be noticed; so is a
call whose client disconnects while it generates (the worker sees the request dropped).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .fake_backend_state import FakeBackendState, HeldCall
from .fake_staging import StagingDir, stage_completion

DEFAULT_MODEL = "fake-model"
# The directory the backend stages admitted calls into when --staging-dir is not given.
STAGING_DIR_ENV = "NG_FAKE_STAGING_DIR"
_ROUNDS = re.compile(r"\[tool_rounds=(\d+)\]")
_ANSWER_WORDS = re.compile(r"\[answer_words=(\d+)\]")
FINAL_ANSWER = "It is cold in San Francisco today."


def _text(content: Any) -> str:
    """The text of a chat message's content, whether a string or a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def conversation_of(messages: list[dict[str, Any]]) -> tuple[str, int]:
    """``(conversation, step)`` of a chat request: first user text, count of assistant messages."""
    users = [m for m in messages if m.get("role") == "user"]
    conversation = _text(users[0].get("content")) if users else ""
    step = sum(1 for m in messages if m.get("role") == "assistant")
    return conversation, step


def _arguments_for(schema: dict[str, Any]) -> dict[str, Any]:
    properties = schema.get("properties") or {}
    arguments: dict[str, Any] = {}
    for name in schema.get("required") or list(properties):
        kind = (properties.get(name) or {}).get("type")
        if name == "city":
            arguments[name] = "San Francisco"
        elif kind in ("integer", "number"):
            arguments[name] = 1
        elif kind == "boolean":
            arguments[name] = True
        else:
            arguments[name] = "x"
    return arguments


def tool_rounds(conversation: str) -> int:
    """How many tool calls a turn of ``conversation`` makes before its answer (``[tool_rounds=N]``, else 1)."""
    found = _ROUNDS.search(conversation)
    return int(found.group(1)) if found else 1


def completion_for(body: dict[str, Any], conversation: str, step: int) -> dict[str, Any]:
    """The deterministic chat completion for a request (see the module docstring)."""
    messages = body.get("messages") or []
    tools = [t for t in body.get("tools") or [] if t.get("type") == "function"]
    tool_results = sum(1 for m in messages if m.get("role") == "tool")
    if tools and tool_results < tool_rounds(conversation):
        function = tools[0]["function"]
        # Stable across processes (unlike hash()), so a replayed step gets the same call id.
        call_id = "call_" + hashlib.sha256(f"{step}:{conversation}".encode()).hexdigest()[:16]
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "name": function["name"],
                        "arguments": json.dumps(_arguments_for(function.get("parameters") or {})),
                    },
                }
            ],
        }
        finish_reason = "tool_calls"
    else:
        extra = _ANSWER_WORDS.search(conversation)
        words = " ".join(f"word{i}" for i in range(int(extra.group(1)))) if extra else ""
        message = {"role": "assistant", "content": f"{FINAL_ANSWER} {words}".rstrip()}
        finish_reason = "stop"
    prompt_tokens = sum(len(_text(m.get("content")).split()) for m in messages)
    completion_tokens = 8
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
    completion: dict[str, Any] = {
        "id": f"chatcmpl-fake-{step}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model") or DEFAULT_MODEL,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    if body.get("logprobs") or body.get("return_tokens_as_token_ids"):
        # Asked as vLLM is asked for token ids (Gym's return_token_id_information): answer as vLLM does.
        from .fake_tokens import token_fields

        completion["prompt_token_ids"], fields = token_fields(messages, message)
        choice.update(fields)
    return completion


async def _wait_released(request: Request, state: FakeBackendState, call: HeldCall) -> bool:
    """Wait until released; False when the client went away first (the call is then abandoned).

    Event-driven (a disconnect is the request's next ASGI message), so a thousand held calls cost nothing.
    """
    released = asyncio.ensure_future(call.released.wait())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({released, gone}, return_when=asyncio.FIRST_COMPLETED)
        if released.done():
            return True
    finally:
        released.cancel()
        gone.cancel()
    state.abandoned(call)
    return False


async def _disconnected(request: Request) -> None:
    """Return once the client went away (the body was read already: only a disconnect can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _generate(request: Request, state: FakeBackendState) -> bool:
    """Spend ``delay_seconds`` generating; False when the client went away first (the call is abandoned)."""
    if state.delay_seconds <= 0:
        return True
    state.generating += 1
    # The delay is the simulated generation time itself, not a stand-in for a condition.
    work = asyncio.ensure_future(asyncio.sleep(state.delay_seconds))  # wait-ok: simulated generation
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finished = work.done()
    finally:
        state.generating -= 1
        work.cancel()
        gone.cancel()
    if not finished:
        state.abandoned_total += 1
        return False
    return True


def create_app(
    state: FakeBackendState | None = None, model: str = DEFAULT_MODEL, staging_dir: str | Path | None = None
) -> FastAPI:
    """The backend's ASGI app; ``state`` is exposed as ``app.state.fake`` for in-process tests."""
    state = state or FakeBackendState()
    app = FastAPI(title="fake inference backend")
    app.state.fake = state
    staging = StagingDir(staging_dir or os.environ.get(STAGING_DIR_ENV) or "fake-staging")

    @app.get("/")
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "fake"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return _bad_request("body is not JSON")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _bad_request("body must be an object with a messages list")
        if body.get("stream"):
            return _bad_request("streaming is not supported by the fake backend")
        conversation, step = conversation_of(body["messages"])
        call = state.arrive(conversation, step)
        if call is not None and not await _wait_released(request, state, call):
            return JSONResponse({"error": {"message": "client went away"}}, status_code=499)
        if not await _generate(request, state):
            return JSONResponse({"error": {"message": "client went away"}}, status_code=499)
        state.answered(conversation, step)
        completion = completion_for(body, conversation, step)
        stage_completion(body, completion, staging)
        return JSONResponse(completion)

    @app.post("/_fake/hold")
    async def hold(request: Request) -> JSONResponse:
        body = await _control_body(request)
        if body is None:
            return _bad_request("body must be a JSON object")
        match, count, step = body.get("match", ""), body.get("count", 1), body.get("step")
        if not isinstance(match, str) or not isinstance(count, int) or count < 1:
            return _bad_request("hold takes match (string) and count (int >= 1)")
        if step is not None and not isinstance(step, int):
            return _bad_request("step must be an int or null")
        rule = state.add_rule(match, count, step)
        return JSONResponse({"rule_id": rule.rule_id})

    @app.post("/_fake/release")
    async def release(request: Request) -> JSONResponse:
        body = await _control_body(request)
        if body is None:
            return _bad_request("body must be a JSON object")
        match = body.get("match")
        if match is not None and not isinstance(match, str):
            return _bad_request("match must be a string or null")
        rules_dropped = state.drop_rules(match)
        return JSONResponse({"released": state.release(match), "rules_dropped": rules_dropped})

    @app.post("/_fake/delay")
    async def delay(request: Request) -> JSONResponse:
        body = await _control_body(request)
        seconds = None if body is None else body.get("seconds", 0)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 3600:
            return _bad_request("delay takes seconds (a number from 0 to 3600)")
        state.delay_seconds = float(seconds)
        return JSONResponse({"delay_seconds": state.delay_seconds})

    @app.get("/_fake/stats")
    async def stats(brief: bool = False) -> dict[str, Any]:
        return state.counts() if brief else state.stats()

    @app.post("/_fake/reset")
    async def reset() -> dict[str, int]:
        return {"released": state.reset()}

    return app


async def _control_body(request: Request) -> dict[str, Any] | None:
    """The JSON object of a control call (empty body: ``{}``); None when it is not an object."""
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _bad_request(detail: str) -> JSONResponse:
    return JSONResponse({"error": {"message": detail, "type": "BadRequestError", "code": 400}}, status_code=400)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--staging-dir", default=None,
                        help=f"where calls admitted for external token staging are staged (default ${STAGING_DIR_ENV} "
                             "or ./fake-staging)")
    args = parser.parse_args(argv)
    app = create_app(model=args.model, staging_dir=args.staging_dir)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
