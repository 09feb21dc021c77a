"""The admission gate, driven over HTTP in-process against a small FastAPI app.

Parking is observed through the gate's ``parked`` counter and the routes the app
recorded as entered, never through timing.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from control_support import wait_until
from fastapi import FastAPI, Request, Response
from nemo_gym.rollout_correlation import RolloutContextMiddleware, current_rollout_id
from pydantic import BaseModel, ConfigDict
from starlette.middleware.base import BaseHTTPMiddleware

from nemo_gym_checkpoint_plugin._admission import Admission, RetiredMarks
from nemo_gym_checkpoint_plugin._gate import (
    AdmissionGate,
    GateCounters,
    attempt_from_path,
    attempt_from_run_body,
    install_gate,
)
from nemo_gym_checkpoint_plugin._identity import EpisodeId

EXEMPT_PATHS = ["/", "/health", "/healthz", "/livez", "/readyz", "/ng-control/v1/checkpoint/status"]


class RunBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    episode_id: EpisodeId
    task: dict[str, Any] = {}


def make_app(entered: list[str]) -> FastAPI:
    """A participant-like app: a data GET, an environment ``/run``, a rollout-prefixed route, health, control."""
    app = FastAPI()

    @app.get("/items")
    async def items() -> dict[str, bool]:
        entered.append("/items")
        return {"ok": True}

    @app.post("/run")
    async def run(body: RunBody, request: Request) -> Response:
        entered.append(f"/run {body.episode_id.capture_key}")
        # Echo the raw bytes so a test can compare them with what the client sent.
        return Response(await request.body(), media_type="application/octet-stream")

    # Like Gym's agent server, which routes the prefix itself instead of stripping it.
    @app.post("/ng-rollout/{key}/v1/responses")
    async def responses(key: str) -> dict[str, str]:
        entered.append(f"responses {key}")
        return {"key": key}

    async def liveness() -> dict[str, str]:
        return {"status": "ok"}

    for path in EXEMPT_PATHS[:-1]:
        app.get(path)(liveness)

    @app.get("/ng-control/v1/checkpoint/status")
    async def status() -> dict[str, str]:
        return {"phase": "preparing"}

    return app


@dataclass
class Gated:
    admission: Admission
    marks: RetiredMarks
    counters: GateCounters
    client: httpx.AsyncClient
    entered: list[str] = field(default_factory=list)


@pytest.fixture
async def gated() -> AsyncIterator[Gated]:
    entered: list[str] = []
    app = make_app(entered)
    admission, marks = Admission(), RetiredMarks()
    counters = install_gate(app, admission, marks)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gym") as client:
        yield Gated(admission, marks, counters, client, entered)


async def bounded[T](awaitable: Awaitable[T]) -> T:
    """Await a reply with a bound: a gate that wrongly parks must fail the test, not hang it."""
    return await asyncio.wait_for(awaitable, timeout=10)


def run_body(rollout_id: str, attempt: int, **extra: Any) -> bytes:
    return json.dumps({"episode_id": {"rollout_id": rollout_id, "attempt": attempt}, **extra}).encode()


JSON = {"content-type": "application/json"}

# One request of each kind the gate attributes differently, as (method, path, body).
REQUEST_KINDS = {
    "plain": ("GET", "/items", None),
    "run_body": ("POST", "/run", run_body("r1", 0)),
    "path_prefix": ("POST", "/ng-rollout/r1-a1/v1/responses", b"{}"),
}


def send(g: Gated, kind: str) -> asyncio.Task[httpx.Response]:
    method, path, body = REQUEST_KINDS[kind]
    return asyncio.create_task(g.client.request(method, path, content=body, headers=JSON))


def assert_stale(reply: httpx.Response) -> None:
    assert reply.status_code == 409
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "detail"}
    assert body["error"]["code"] == "stale_attempt"


# --- attribution helpers -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/ng-rollout/r/v1/responses", ("r", 0)),
        ("/ng-rollout/r-a3/v1/responses", ("r", 3)),
        ("/ng-rollout/r-a3/training-token-capture/v1/responses", ("r", 3)),
        ("/ng-rollout/r-a0/verify", ("r-a0", 0)),  # -a0 is a plain id, as in Gym
        ("/ng-rollout/r", None),  # no rest: Gym does not strip it either
        ("/ng-rollout//verify", None),
        ("/ng-rollout/.hidden/verify", None),
        ("/verify", None),
    ],
)
def test_attempt_from_path(path: str, expected: tuple[str, int] | None) -> None:
    assert attempt_from_path(path) == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (run_body("r", 2), ("r", 2)),
        (b'{"episode_id": {"rollout_id": "r"}}', ("r", 0)),
        (b"", None),
        (b"not json", None),
        (b"\xff\xfe", None),
        (b"[1, 2]", None),
        (b'{"task": {}}', None),
        (b'{"episode_id": "r"}', None),
        (b'{"episode_id": {"rollout_id": "r-a2", "attempt": 1}}', None),
        (b'{"episode_id": {"rollout_id": "r", "attempt": -1}}', None),
        (b"[" * 5000, None),
        # Legacy rows (legacy_agent) name their episode the way Gym derives its capture key.
        (b'{"_ng_rollout_id": "r-a2"}', ("r", 2)),
        (b'{"_ng_task_index": 3, "_ng_rollout_index": 1}', ("3-1", 0)),
        (b'{"_ng_rollout_id": "bad id!"}', None),
        (b'{"_ng_rollout_id": 7}', None),
    ],
)
def test_attempt_from_run_body(body: bytes, expected: tuple[str, int] | None) -> None:
    assert attempt_from_run_body(body) == expected


_EPISODE_TEXT = '{"episode_id": {"rollout_id": "r", "attempt": 2}, "task": {"t": "\u00e9"}}'
# What Gym's routes parse (Starlette's request.json() is json.loads(bytes)) but orjson does not.
GYM_ONLY_BODIES = {
    "utf16_le": _EPISODE_TEXT.encode("utf-16-le"),
    "utf16_be": _EPISODE_TEXT.encode("utf-16-be"),
    "utf16_bom": _EPISODE_TEXT.encode("utf-16"),
    "utf32_le": _EPISODE_TEXT.encode("utf-32-le"),
    "utf32_be": _EPISODE_TEXT.encode("utf-32-be"),
    "utf32_bom": _EPISODE_TEXT.encode("utf-32"),
    "utf8_bom": _EPISODE_TEXT.encode("utf-8-sig"),
    "nan": b'{"episode_id": {"rollout_id": "r", "attempt": 2}, "score": NaN}',
    "legacy_row_utf16": '{"_ng_rollout_id": "r-a2"}'.encode("utf-16-le"),
}


@pytest.mark.parametrize("name", sorted(GYM_ONLY_BODIES))
def test_bodies_gym_reads_are_attributed_as_gym_reads_them(name: str) -> None:
    body = GYM_ONLY_BODIES[name]
    with pytest.raises(ValueError):
        orjson.loads(body)
    json.loads(body)  # what Gym's route does with it
    assert attempt_from_run_body(body) == ("r", 2)


@pytest.mark.parametrize(
    "body",
    [b"\xff\xfe", b"\xff\xfe\x00\x00", b'{"episode_id": "\xe9"}', b"\x00\x00\x00[" * 3, "[".encode("utf-16-le") * 5000],
)
def test_bodies_neither_reads_are_not_attributed(body: bytes) -> None:
    assert attempt_from_run_body(body) is None


# --- parking --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(REQUEST_KINDS))
async def test_data_request_parks_while_closed_and_completes_after_open(gated: Gated, kind: str) -> None:
    gated.marks.mark("someone-else", 3)  # marks of other rollouts do not refuse this one
    gated.admission.close()
    task = send(gated, kind)
    await wait_until(lambda: gated.counters.parked == 1)
    assert not task.done() and gated.entered == []

    gated.admission.open()
    reply = await bounded(task)
    assert reply.status_code == 200, reply.text
    assert len(gated.entered) == 1 and gated.counters.parked == 0 and gated.counters.parks == 1


@pytest.mark.parametrize("path", EXEMPT_PATHS)
async def test_health_and_control_routes_pass_while_closed(gated: Gated, path: str) -> None:
    gated.marks.mark("r1", 5)
    gated.admission.close()
    reply = await bounded(gated.client.get(path))
    assert reply.status_code == 200
    assert gated.counters.parks == 0


async def test_wake_into_a_new_checkpoint_parks_again(gated: Gated) -> None:
    gated.admission.close()
    first = send(gated, "plain")
    await wait_until(lambda: gated.counters.parked == 1)

    # Resume, and a new checkpoint closes admission before the parked request ran again.
    gated.admission.open()
    gated.admission.close()
    # The second request starts after the first was woken, so once it parked the first has seen
    # the new closure: it either parked again (2 parked) or entered the app (the bug).
    second = send(gated, "run_body")
    await wait_until(lambda: gated.counters.parked == 2 or bool(gated.entered))
    assert gated.counters.parked == 2 and gated.entered == []
    assert not first.done()

    gated.admission.open()
    replies = await bounded(asyncio.gather(first, second))
    assert [r.status_code for r in replies] == [200, 200]
    assert sorted(gated.entered) == ["/items", "/run r1"]


async def test_cancelled_parked_request_leaves_the_count(gated: Gated) -> None:
    gated.admission.close()
    task = send(gated, "plain")
    await wait_until(lambda: gated.counters.parked == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gated.counters.parked == 0 and gated.entered == []


# --- stale attempts -------------------------------------------------------------------------


async def test_stale_attempt_by_path_prefix(gated: Gated) -> None:
    gated.marks.mark("r7", 1)
    for key in ("r7", "r7-a1"):
        assert_stale(await bounded(gated.client.post(f"/ng-rollout/{key}/v1/responses", content=b"{}")))
    reply = await bounded(gated.client.post("/ng-rollout/r7-a2/v1/responses", content=b"{}"))
    assert reply.status_code == 200 and reply.json() == {"key": "r7-a2"}
    assert gated.entered == ["responses r7-a2"] and gated.counters.refused == 2


async def test_stale_attempt_by_run_body(gated: Gated) -> None:
    gated.marks.mark("r7", 1)
    reply = await bounded(gated.client.post("/run", content=run_body("r7", 1), headers=JSON))
    assert_stale(reply)
    assert "r7" in reply.json()["error"]["detail"]
    assert (await bounded(gated.client.post("/run", content=run_body("r7", 2), headers=JSON))).status_code == 200
    assert gated.entered == ["/run r7-a2"]


@pytest.mark.parametrize("kind", ["run_body", "path_prefix"])
async def test_retired_request_is_refused_before_it_parks(gated: Gated, kind: str) -> None:
    gated.marks.mark("r1", 1)
    gated.admission.close()
    assert_stale(await bounded(send(gated, kind)))
    assert gated.counters.parks == 0 and gated.entered == []


@pytest.mark.parametrize("kind", ["run_body", "path_prefix"])
async def test_attempt_retired_while_parked_is_refused_when_it_wakes(gated: Gated, kind: str) -> None:
    gated.admission.close()
    retired = send(gated, kind)
    unrelated = send(gated, "plain")
    await wait_until(lambda: gated.counters.parked == 2)

    gated.marks.mark("r1", 1)
    gated.admission.open()
    assert_stale(await bounded(retired))
    assert (await bounded(unrelated)).status_code == 200
    assert gated.entered == ["/items"]


@pytest.mark.parametrize("kind", ["run_body", "path_prefix"])
async def test_parked_attempt_is_refused_as_soon_as_it_is_marked(gated: Gated, kind: str) -> None:
    gated.admission.close()
    retired = send(gated, kind)
    unrelated = send(gated, "plain")
    await wait_until(lambda: gated.counters.parked == 2)

    gated.marks.mark("r1", 1)
    # Admission stays closed: the retired request does not wait for resume.
    assert_stale(await bounded(retired))
    assert gated.counters.parked == 1 and not unrelated.done() and gated.entered == []

    gated.admission.open()
    assert (await bounded(unrelated)).status_code == 200


@pytest.mark.parametrize("kind", ["run_body", "path_prefix"])
async def test_parked_attempt_stays_refused_when_forgotten_before_admission_reopens(gated: Gated, kind: str) -> None:
    gated.admission.close()
    retired = send(gated, kind)
    await wait_until(lambda: gated.counters.parked == 1)

    # Marked and forgotten before the parked request even ran again, then admission reopens.
    gated.marks.mark("r1", 1)
    gated.marks.forget("r1")
    gated.admission.open()
    reply = await bounded(retired)
    assert_stale(reply)
    assert "forgotten" in reply.json()["error"]["detail"]
    assert gated.entered == [] and len(gated.marks) == 0


def test_mark_many_keeps_each_rollouts_highest_attempt_and_never_lowers_a_mark() -> None:
    marks = RetiredMarks()
    marks.mark("r1", 2)
    # A scope may name a rollout twice, its lower attempt last; an earlier mark above the scope's stays.
    marks.mark_many([("r0", 3), ("r0", 1), ("r1", 1), ("r2", 0)])
    assert marks.snapshot() == {"r0": 3, "r1": 2, "r2": 0}
    assert marks.is_retired("r0", 2) and not marks.is_retired("r0", 4)


@pytest.mark.parametrize("kind", ["run_body", "path_prefix"])
async def test_mark_many_refuses_a_parked_attempt_as_mark_does(gated: Gated, kind: str) -> None:
    gated.admission.close()
    retired = send(gated, kind)
    unrelated = send(gated, "plain")
    await wait_until(lambda: gated.counters.parked == 2)

    gated.marks.mark_many([("r0", 5), ("r1", 1)])
    assert_stale(await bounded(retired))
    assert gated.counters.parked == 1 and not unrelated.done() and gated.entered == []
    gated.admission.open()
    assert (await bounded(unrelated)).status_code == 200


async def test_mark_of_a_later_attempt_only_leaves_an_earlier_parked_one_parked(gated: Gated) -> None:
    gated.admission.close()
    later = send(gated, "path_prefix")  # r1-a1
    await wait_until(lambda: gated.counters.parked == 1)
    gated.marks.mark("r1", 0)  # below the parked attempt: it keeps waiting
    assert gated.marks.retired_parked(["r1"]) == 0
    gated.admission.open()
    assert (await bounded(later)).status_code == 200


async def test_retire_replies_only_after_parked_requests_of_its_attempts_were_answered() -> None:
    from nemo_gym_checkpoint_plugin._control import ControlPlane
    from nemo_gym_checkpoint_plugin._plugins import make_plugin_manager

    plane = ControlPlane(make_plugin_manager([], load_entry_points=False), kind="environment", instance="env")
    entered: list[str] = []
    app = make_app(entered)
    counters = install_gate(app, plane.admission, plane.marks)
    release = asyncio.Event()

    async def slow_client(scope: Any, receive: Any, send: Any) -> None:
        # The refusal reaches a client that reads slowly: its first message waits for ``release``.
        async def held_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                await release.wait()
            await send(message)

        await app(scope, receive, held_send)

    # As after a restore (phase restored): admission is closed while the retire runs.
    plane.admission.close()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=slow_client), base_url="http://gym") as client:
        parked = asyncio.create_task(client.post("/run", content=run_body("r1", 0), headers=JSON))
        await wait_until(lambda: counters.parked == 1)
        retire = asyncio.create_task(plane.retire("op-1", time.time() + 10, [EpisodeId(rollout_id="r1", attempt=0)]))
        await wait_until(lambda: counters.refused == 1, what="the parked request refused at once")
        # Its reply is still on its way out, so the retire has not replied. Without that wait the retire
        # (no participant hooks, no I/O) ends within a few loop passes: give it many.
        for _ in range(100):
            await asyncio.sleep(0)
        assert not retire.done()
        release.set()
        assert (await bounded(retire)) == {"retired_count": 1}
        assert_stale(await bounded(parked))
    assert plane.marks.retired_parked(["r1"]) == 0 and entered == []
    await plane.aclose()


# --- bodies ---------------------------------------------------------------------------------


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.mark.parametrize("closed", [False, True])
async def test_run_body_is_replayed_intact(gated: Gated, closed: bool) -> None:
    gated.marks.mark("other", 0)  # forces the gate to read the body
    # Byte-exact: odd spacing, key order, escapes, non-ASCII, a big integer, sent in many chunks.
    body = (
        b'{ "task" : {"z": 1, "a": "\\u00e9t\\u00e9 \xc3\xa9", "n": 123456789012345678901234567890, "pad": "'
        + b"x" * 70_000
        + b'"},\n "episode_id": {"attempt": 4, "rollout_id": "r1"}  }'
    )
    if closed:
        gated.admission.close()
    task = asyncio.create_task(gated.client.post("/run", content=_chunks(body, 4096), headers=JSON))
    if closed:
        await wait_until(lambda: gated.counters.parked == 1)
        gated.admission.open()
    reply = await bounded(task)
    assert reply.status_code == 200, reply.text
    assert reply.content == body
    assert gated.entered == ["/run r1-a4"]


@pytest.mark.parametrize("name", sorted(GYM_ONLY_BODIES))
@pytest.mark.parametrize("closed", [False, True])
async def test_retired_run_body_in_any_encoding_gym_reads_is_refused(gated: Gated, name: str, closed: bool) -> None:
    gated.marks.mark("r", 2)
    if closed:
        gated.admission.close()
    assert_stale(await bounded(gated.client.post("/run", content=GYM_ONLY_BODIES[name], headers=JSON)))
    assert gated.entered == [] and gated.counters.parks == 0


@pytest.mark.parametrize("name", ["utf16_le", "utf32_bom", "utf8_bom"])
async def test_live_run_body_in_another_encoding_reaches_the_app_intact(gated: Gated, name: str) -> None:
    gated.marks.mark("r", 1)  # an earlier attempt: the gate reads the body, attempt 2 passes
    body = GYM_ONLY_BODIES[name]
    reply = await bounded(gated.client.post("/run", content=body, headers=JSON))
    assert reply.status_code == 200, reply.text
    assert reply.content == body and gated.entered == ["/run r-a2"]


MALFORMED_BODIES = {
    "empty": b"",
    "not_json": b"{not json",
    "bad_utf8": b"\xff\xfe",
    "array": b"[1, 2]",
    "no_episode": b'{"task": {}}',
    "episode_not_object": b'{"episode_id": "r1"}',
    "ambiguous_episode": b'{"episode_id": {"rollout_id": "r1-a2", "attempt": 1}}',
    "negative_attempt": b'{"episode_id": {"rollout_id": "r1", "attempt": -1}}',
    "too_deep": b"[" * 5000,
    "too_deep_utf16": "[".encode("utf-16-le") * 5000,
    "latin1": b'{"episode_id": {"rollout_id": "\xe9", "attempt": 0}}',
    "utf16_no_episode": '{"task": {}}'.encode("utf-16"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED_BODIES))
async def test_malformed_run_body_reaches_the_app_validation(gated: Gated, name: str) -> None:
    gated.marks.mark("r1", 0)  # the gate has to look at every /run body
    gated.admission.close()
    task = asyncio.create_task(gated.client.post("/run", content=MALFORMED_BODIES[name], headers=JSON))
    # Not attributable, so an ordinary data request: it parks, then the app answers.
    await wait_until(lambda: gated.counters.parked == 1)
    gated.admission.open()
    reply = await bounded(task)
    # The app's own validation answers (a body FastAPI cannot decode is its 400), never the gate.
    assert reply.status_code in (400, 422) and "stale_attempt" not in reply.text
    assert gated.counters.refused == 0


# --- installation ---------------------------------------------------------------------------


async def test_not_installed_app_has_no_middleware_and_ignores_admission() -> None:
    entered: list[str] = []
    plain, gated_app = make_app(entered), make_app(entered)
    admission, marks = Admission(), RetiredMarks()
    install_gate(gated_app, admission, marks)

    assert plain.user_middleware == []
    assert [m.cls for m in gated_app.user_middleware] == [AdmissionGate]
    assert not issubclass(AdmissionGate, BaseHTTPMiddleware)

    # The same state that would park and refuse has no effect on an app without the gate.
    admission.close()
    marks.mark("r1", 5)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=plain), base_url="http://gym") as client:
        assert (await bounded(client.get("/items"))).status_code == 200
        assert (await bounded(client.post("/run", content=run_body("r1", 1), headers=JSON))).status_code == 200
    assert entered == ["/items", "/run r1-a1"]


def test_install_twice_is_refused() -> None:
    app = make_app([])
    install_gate(app, Admission(), RetiredMarks())
    with pytest.raises(RuntimeError, match="already installed"):
        install_gate(app, Admission(), RetiredMarks())
    assert len(app.user_middleware) == 1


async def test_gate_sees_the_raw_prefix_and_gym_still_strips_it() -> None:
    """As on a Gym resources server: its RolloutContextMiddleware strips the prefix inside the gate."""
    app = FastAPI()
    app.add_middleware(RolloutContextMiddleware)  # what SimpleResourcesServer.setup_webserver adds

    @app.post("/verify")
    async def verify(request: Request) -> dict[str, Any]:
        return {
            "path": request.scope["path"],
            "raw_path": request.scope["raw_path"].decode(),
            "key": current_rollout_id(),
        }

    marks = RetiredMarks()
    install_gate(app, Admission(), marks)  # after setup_webserver, as the attachment does
    marks.mark("r9", 0)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gym") as client:
        assert_stale(await bounded(client.post("/ng-rollout/r9/verify", json={})))
        reply = await bounded(client.post("/ng-rollout/r9-a1/verify", json={}))
    assert reply.status_code == 200
    assert reply.json() == {"path": "/verify", "raw_path": "/verify", "key": "r9-a1"}
