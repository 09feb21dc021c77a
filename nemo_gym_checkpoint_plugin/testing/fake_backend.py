"""A deterministic OpenAI-compatible fake inference backend that can hold calls, pause and generate at a set rate.

Run it with ``python -m nemo_gym_checkpoint_plugin.testing.fake_backend --port N``; it stands
in for vLLM in the testing kit's deployment, the demo and ``serve``.

Gym's ``vllm_model`` server talks to it exactly as to vLLM (the fields it serves are vLLM's, see
``fake_generation.py``): ``GET /v1/models``, ``POST /v1/chat/completions`` (OpenAI chat format,
whole or ``stream: true``), ``POST /v1/completions`` with a token-id ``prompt`` (a prompt its
chat template rendered, optionally followed by tokens of a partial answer, which it continues),
``POST /tokenize`` (chat messages) and ``POST /detokenize``. The answer depends only on the
messages (``fake_answers.py``), so a rollout replayed after a crash gets the same answers; its
tokens come from ``fake_tokens.py`` (one per word, a chat template whose prompts chain across the
calls of a turn). With ``--reasoning-parser`` it splits ``<think>`` reasoning off as vLLM's
``--reasoning-parser`` does; tool calls are always parsed (vLLM's ``--tool-call-parser hermes``).

vLLM's dev-mode routes (``VLLM_SERVER_DEV_MODE=1``) are served unless ``--no-dev-routes``:
``POST /pause?mode=keep`` freezes every generation in place (only ``keep`` is offered),
``POST /resume`` lets them go on, ``GET /is_paused``.

A request carrying Gym's token-staging admission (``ng_capture``: ``token_id_capture`` with
``external_staging: true``) is staged as a vLLM worker with Gym's capture installed stages it
(``fake_staging.py``: the staged calls go to ``--staging-dir``, default ``$NG_FAKE_STAGING_DIR``
or ``./fake-staging``) and acknowledged with ``ng_commit_coords``.

A **conversation** is named by the text of its first ``user`` message (tests put the rollout id
in it; a token-id prompt's is its words one space apart); its **step** is the number of
``assistant`` messages already in the request (0 for the first call of a turn, 1 after one tool
round trip...).

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
  conversation/step that arrived more than once), ``generated`` (``{conversation: tokens
  generated}``) and ``generated_total``, ``paused``, ``tokens_per_second``.
- ``GET /_fake/generated``: ``{"generated_total", "generated", "paused"}`` alone.
- ``POST /_fake/reset``: drop counters, rules, the delay and the rate, resume, and release every
  held call.
- ``POST /_fake/delay {"seconds": 0}``: every call waits that long before its first token (a held
  call after its release); ``generating`` in stats counts the calls inside that time now.
- ``POST /_fake/rate {"tokens_per_second": 0}``: generate tokens one by one at that rate (0: as
  fast as the event loop goes).
- ``POST /_fake/pause_behavior {"hang": false}``: with ``hang`` true, ``/pause`` freezes and then
  never answers (a worker whose pause hangs).
- ``POST /_fake/pause_at {"match": "", "tokens": N}``: once a conversation containing ``match`` has
  generated N tokens (counted since the last reset), the backend pauses itself as ``/pause?mode=keep``
  does, right after that token (a test's cut at an exact point); used once.

A held call whose client disconnects (its caller was killed) is dropped from ``held``
and counted in ``abandoned_total``, so a test can wait for a crash to be noticed; so is a
call whose client disconnects while it generates (the worker sees the request dropped), and a
stream whose client goes away stops generating.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .fake_answers import FINAL_ANSWER, answer_for, conversation_of, tool_rounds
from .fake_backend_state import FakeBackendState, HeldCall
from .fake_controls import add_control_routes, add_dev_routes, bad_request, disconnected, gone
from .fake_generation import ChatGeneration, CompletionGeneration
from .fake_staging import StagingDir, stage_completion
from .fake_tokens import decode_prompt

__all__ = [
    "DEFAULT_MODEL",
    "FINAL_ANSWER",
    "FakeBackendState",
    "HeldCall",
    "conversation_of",
    "create_app",
    "tool_rounds",
]

DEFAULT_MODEL = "fake-model"
# The directory the backend stages admitted calls into when --staging-dir is not given.
STAGING_DIR_ENV = "NG_FAKE_STAGING_DIR"


async def _wait_released(request: Request, state: FakeBackendState, call: HeldCall) -> bool:
    """Wait until released; False when the client went away first (the call is then abandoned).

    Event-driven (a disconnect is the request's next ASGI message), so a thousand held calls cost nothing.
    """
    released = asyncio.ensure_future(call.released.wait())
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({released, gone}, return_when=asyncio.FIRST_COMPLETED)
        if released.done():
            return True
    finally:
        released.cancel()
        gone.cancel()
    state.abandoned(call)
    return False


async def _unless_gone[T](request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """``(True, result)`` of ``work``, or ``(False, None)`` when the client went away first (``work`` is cancelled)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return True, task.result()
        return False, None
    finally:
        task.cancel()
        gone.cancel()


async def _delay(state: FakeBackendState) -> None:
    if state.delay_seconds <= 0:
        return
    state.generating += 1
    try:
        # The delay is the simulated time to the first token, not a stand-in for a condition.
        await asyncio.sleep(state.delay_seconds)  # wait-ok: simulated generation
    finally:
        state.generating -= 1


async def _admitted(request: Request, state: FakeBackendState, conversation: str, step: int) -> bool:
    """Count the call, wait out a hold and the delay; False when the client went away meanwhile (abandoned)."""
    call = state.arrive(conversation, step)
    if call is not None and not await _wait_released(request, state, call):
        return False
    finished, _ = await _unless_gone(request, _delay(state))
    if not finished:
        state.abandoned_total += 1
    return finished


async def _stream(
    state: FakeBackendState, chunks: AsyncIterator[bytes], conversation: str, step: int
) -> AsyncIterator[bytes]:
    """The chunks of a stream; a stream its client leaves stops generating (Starlette cancels it) and is abandoned."""
    finished = False
    try:
        async for chunk in chunks:
            yield chunk
        finished = True
    finally:
        if finished:
            state.answered(conversation, step)
        else:
            state.abandoned_total += 1


def _event_stream(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream")


def create_app(
    state: FakeBackendState | None = None,
    model: str = DEFAULT_MODEL,
    staging_dir: str | Path | None = None,
    *,
    reasoning_parser: bool = False,
    dev_routes: bool = True,
) -> FastAPI:
    """The backend's ASGI app; ``state`` is exposed as ``app.state.fake`` for in-process tests."""
    state = state or FakeBackendState()
    app = FastAPI(title="fake inference backend")
    app.state.fake = state
    staging = StagingDir(staging_dir or os.environ.get(STAGING_DIR_ENV) or "fake-staging")
    serials = itertools.count(1)

    @app.get("/")
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "fake"}]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
        body = await _json_object(request)
        if body is None or not isinstance(body.get("messages"), list):
            return bad_request("body must be an object with a messages list")
        messages, tools = body["messages"], body.get("tools") or []
        conversation, step = conversation_of(messages)
        if not await _admitted(request, state, conversation, step):
            return gone()
        answer = answer_for(state.vocabulary, messages, tools, conversation, step)
        generation = ChatGeneration(state, body, answer, conversation, step, reasoning_parser)
        if body.get("stream"):
            return _event_stream(_stream(state, generation.stream(), conversation, step))
        finished, completion = await _unless_gone(request, generation.whole())
        if not finished or completion is None:
            state.abandoned_total += 1
            return gone()
        state.answered(conversation, step)
        stage_completion(body, completion, staging, generation.worker_view)
        return JSONResponse(completion)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        body = await _json_object(request)
        prompt = None if body is None else body.get("prompt")
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            return bad_request("the fake backend takes a prompt of token ids only (a list of ints)")
        assert body is not None
        try:
            messages, tools, generated = decode_prompt(state.vocabulary, prompt)
        except ValueError as exc:
            return bad_request(str(exc))
        conversation, step = conversation_of(messages)
        answer = answer_for(state.vocabulary, messages, tools, conversation, step)
        if answer.tokens[: len(generated)] != generated:
            return bad_request("the prompt ends with tokens that are not the start of this fake model's answer")
        if not await _admitted(request, state, conversation, step):
            return gone()
        generation = CompletionGeneration(state, body, answer, conversation, len(generated), prompt, next(serials))
        if body.get("stream"):
            return _event_stream(_stream(state, generation.stream(), conversation, step))
        finished, completion = await _unless_gone(request, generation.whole())
        if not finished:
            state.abandoned_total += 1
            return gone()
        state.answered(conversation, step)
        return JSONResponse(completion)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await _json_object(request)
        if body is None or not isinstance(body.get("messages"), list):
            return bad_request("the fake backend tokenizes chat messages only (a messages list)")
        tokens = state.vocabulary.render(body["messages"], body.get("tools") or [])
        return JSONResponse({"count": len(tokens), "max_model_len": 1_000_000, "tokens": tokens})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await _json_object(request)
        tokens = None if body is None else body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return bad_request("detokenize takes tokens (a list of ints)")
        try:
            return JSONResponse({"prompt": state.vocabulary.text(tokens)})
        except KeyError as exc:
            return bad_request(f"token id {exc.args[0]} is not in this fake backend's vocabulary")

    if dev_routes:
        add_dev_routes(app, state)
    add_control_routes(app, state)
    return app


async def _json_object(request: Request) -> dict[str, Any] | None:
    try:
        body = await request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--staging-dir",
        default=None,
        help=f"where calls admitted for external token staging are staged (default ${STAGING_DIR_ENV} "
        "or ./fake-staging)",
    )
    parser.add_argument(
        "--reasoning-parser",
        action="store_true",
        help="split <think> reasoning off the answer, as vLLM's --reasoning-parser does",
    )
    parser.add_argument(
        "--no-dev-routes",
        action="store_true",
        help="serve no /pause, /resume, /is_paused (vLLM without VLLM_SERVER_DEV_MODE)",
    )
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=0.0,
        help="generate tokens one by one at this rate (default 0: as fast as possible)",
    )
    args = parser.parse_args(argv)
    state = FakeBackendState()
    state.tokens_per_second = args.tokens_per_second
    app = create_app(
        state,
        model=args.model,
        staging_dir=args.staging_dir,
        reasoning_parser=args.reasoning_parser,
        dev_routes=not args.no_dev_routes,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
