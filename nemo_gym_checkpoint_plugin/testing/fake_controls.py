"""The fake backend's routes beyond inference: vLLM's dev-mode pause and the test controls (``/_fake/...``).

``fake_backend.py``'s docstring says what each does.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .fake_backend_state import FakeBackendState

__all__ = ["add_control_routes", "add_dev_routes", "bad_request", "disconnected", "gone"]


async def disconnected(request: Request) -> None:
    """Return once the client went away (the body was read already: only a disconnect can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def gone() -> JSONResponse:
    return JSONResponse({"error": {"message": "client went away"}}, status_code=499)


def bad_request(detail: str) -> JSONResponse:
    return JSONResponse({"error": {"message": detail, "type": "BadRequestError", "code": 400}}, status_code=400)


def add_dev_routes(app: FastAPI, state: FakeBackendState) -> None:
    """vLLM's dev-mode pause routes (``VLLM_SERVER_DEV_MODE=1``), ``mode=keep`` only."""

    @app.post("/pause")
    async def pause(request: Request, mode: str = "abort") -> JSONResponse:
        if mode != "keep":
            return bad_request("the fake backend pauses with mode=keep only (requests frozen in place)")
        state.pause()
        if state.pause_hangs:
            await disconnected(request)  # a worker whose pause never answers; the caller gives up
            return gone()
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume() -> JSONResponse:
        state.resume()
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": state.paused})


def add_control_routes(app: FastAPI, state: FakeBackendState) -> None:
    @app.post("/_fake/hold")
    async def hold(request: Request) -> JSONResponse:
        body = await control_body(request)
        if body is None:
            return bad_request("body must be a JSON object")
        match, count, step = body.get("match", ""), body.get("count", 1), body.get("step")
        if not isinstance(match, str) or not isinstance(count, int) or count < 1:
            return bad_request("hold takes match (string) and count (int >= 1)")
        if step is not None and not isinstance(step, int):
            return bad_request("step must be an int or null")
        rule = state.add_rule(match, count, step)
        return JSONResponse({"rule_id": rule.rule_id})

    @app.post("/_fake/release")
    async def release(request: Request) -> JSONResponse:
        body = await control_body(request)
        if body is None:
            return bad_request("body must be a JSON object")
        match = body.get("match")
        if match is not None and not isinstance(match, str):
            return bad_request("match must be a string or null")
        rules_dropped = state.drop_rules(match)
        return JSONResponse({"released": state.release(match), "rules_dropped": rules_dropped})

    @app.post("/_fake/delay")
    async def delay(request: Request) -> JSONResponse:
        body = await control_body(request)
        seconds = None if body is None else body.get("seconds", 0)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 3600:
            return bad_request("delay takes seconds (a number from 0 to 3600)")
        state.delay_seconds = float(seconds)
        return JSONResponse({"delay_seconds": state.delay_seconds})

    @app.post("/_fake/rate")
    async def rate(request: Request) -> JSONResponse:
        body = await control_body(request)
        value = None if body is None else body.get("tokens_per_second", 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1_000_000:
            return bad_request("rate takes tokens_per_second (a number from 0 to 1e6; 0: no limit)")
        state.tokens_per_second = float(value)
        return JSONResponse({"tokens_per_second": state.tokens_per_second})

    @app.post("/_fake/pause_behavior")
    async def pause_behavior(request: Request) -> JSONResponse:
        body = await control_body(request)
        hang = None if body is None else body.get("hang", False)
        if not isinstance(hang, bool):
            return bad_request("pause_behavior takes hang (a bool)")
        state.pause_hangs = hang
        return JSONResponse({"hang": hang})

    @app.post("/_fake/pause_at")
    async def pause_at(request: Request) -> JSONResponse:
        body = await control_body(request)
        match = None if body is None else body.get("match", "")
        tokens = None if body is None else body.get("tokens")
        if not isinstance(match, str) or isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            return bad_request("pause_at takes match (string) and tokens (int >= 1)")
        state.pause_at = (match, tokens)
        return JSONResponse({"match": match, "tokens": tokens})

    @app.get("/_fake/stats")
    async def stats(brief: bool = False) -> dict[str, Any]:
        return state.counts() if brief else state.stats()

    @app.get("/_fake/generated")
    async def generated() -> dict[str, Any]:
        return {"generated_total": state.generated_total, "generated": dict(state.generated), "paused": state.paused}

    @app.post("/_fake/reset")
    async def reset() -> dict[str, int]:
        return {"released": state.reset()}


async def control_body(request: Request) -> dict[str, Any] | None:
    """The JSON object of a control call (empty body: ``{}``); None when it is not an object."""
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None
