"""A worker's four front steps in one layer (``_workers/front.py``), and ``buffer_body``'s one-message path.

``attach_worker`` installs one ``WorkerFront`` where four stacked middlewares ran. These tests hold it
to the order and the decisions of those four: control forwarded before anything else, an explicit
``"<id>-aN"`` decoded (or refused) before the gate, the gate's refusals and parking on the decoded
attempt, and a restored record claimed only by a request the gate let through.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI, Request

from nemo_gym_checkpoint_plugin._asgi import buffer_body
from nemo_gym_checkpoint_plugin._errors import AttemptRunning
from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._plugins import make_plugin_manager
from nemo_gym_checkpoint_plugin._workers import service
from nemo_gym_checkpoint_plugin._workers.attach import attach_worker
from nemo_gym_checkpoint_plugin._workers.front import WorkerFront
from nemo_gym_checkpoint_plugin._workers.worker import Worker

BOUND = 10.0


def _app(seen: list[tuple[str, bytes]]) -> FastAPI:
    app = FastAPI()

    @app.post("/run")
    async def run(request: Request) -> dict[str, Any]:
        seen.append(("/run", await request.body()))
        return {}

    @app.post("/ng-rollout/{key}/verify")
    async def verify(key: str, request: Request) -> dict[str, Any]:
        seen.append((f"verify {key}", await request.body()))
        return {}

    @app.get("/")
    async def root() -> dict[str, Any]:
        return {}

    return app


def _attached(kind: str, monkeypatch: pytest.MonkeyPatch) -> tuple[FastAPI, Worker, list[tuple[str, bytes]]]:
    monkeypatch.setenv(service.SOCKET_ENV, "/nonexistent/worker.sock")  # never connected: start() is not run
    seen: list[tuple[str, bytes]] = []
    app = _app(seen)
    attachment = attach_worker(app, make_plugin_manager(), kind=kind)
    return app, attachment.worker, seen


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker", timeout=BOUND)


def test_attach_worker_installs_one_front_layer_and_refuses_a_second_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    app, worker, _ = _attached("environment", monkeypatch)
    outer = [m.cls for m in app.user_middleware if m.cls is WorkerFront]
    assert outer == [WorkerFront] and app.user_middleware[0].cls is WorkerFront  # one layer, outermost
    assert app.state.ng_checkpoint_gate is worker.gate
    with pytest.raises(RuntimeError, match="already installed"):
        attach_worker(app, make_plugin_manager(), kind="environment")


async def test_a_control_request_is_forwarded_before_any_other_step(monkeypatch: pytest.MonkeyPatch) -> None:
    app, worker, seen = _attached("environment", monkeypatch)
    worker.admission.close()  # a closed gate would park a data request; control must still pass
    async with _client(app) as http:
        reply = await http.get("/ng-control/v1/checkpoint/status")
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "coordinator_unreachable"
    assert seen == [] and worker.gate.parks == 0 and not worker.admission.served


async def test_an_ambiguous_explicit_id_is_refused_before_the_gate_parks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    app, worker, seen = _attached("environment", monkeypatch)
    worker.admission.close()
    async with _client(app) as http:
        reply = await http.post("/run", content=orjson.dumps({"episode_id": {"rollout_id": "r-a2", "attempt": 3}}))
    assert reply.status_code == 422 and reply.json()["error"]["code"] == "ambiguous_episode_id"
    assert worker.gate.parks == 0 and seen == []


async def test_the_gate_judges_the_decoded_explicit_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    app, worker, seen = _attached("environment", monkeypatch)
    worker.marks.mark("r7", 2)
    async with _client(app) as http:
        retired = await http.post("/run", content=orjson.dumps({"episode_id": {"rollout_id": "r7-a2"}}))
        live = await http.post("/run", content=orjson.dumps({"episode_id": {"rollout_id": "r7-a4"}}))
        stale_path = await http.post("/ng-rollout/r7-a1/verify", content=b"{}")
    assert retired.status_code == 409 and retired.json()["error"]["code"] == "stale_attempt"
    assert stale_path.status_code == 409 and worker.gate.refused == 2
    assert live.status_code == 200
    assert seen == [("/run", orjson.dumps({"episode_id": {"rollout_id": "r7", "attempt": 4}}))]


async def test_a_data_request_parks_while_closed_and_health_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    app, worker, seen = _attached("environment", monkeypatch)
    worker.admission.close()
    body = orjson.dumps({"episode_id": {"rollout_id": "p1", "attempt": 0}})
    async with _client(app) as http:
        assert (await http.get("/")).status_code == 200
        assert not worker.admission.served  # a health request is not a data request
        parked = asyncio.create_task(http.post("/run", content=body))
        async with asyncio.timeout(BOUND):
            while worker.gate.parked != 1:
                await asyncio.sleep(0)
        assert seen == [] and worker.admission.served
        worker.admission.open()
        reply = await asyncio.wait_for(parked, BOUND)
    assert reply.status_code == 200 and seen == [("/run", body)] and worker.gate.parked == 0


class _Claims:
    def __init__(self, error: Exception | None = None) -> None:
        self.claimed: list[EpisodeId] = []
        self.error = error


def _with_claims(worker: Worker, monkeypatch: pytest.MonkeyPatch, claims: _Claims) -> None:
    async def claim(episode: EpisodeId) -> bool:
        claims.claimed.append(episode)
        if claims.error is not None:
            raise claims.error
        worker.restorable.discard(episode.capture_key)
        return True

    monkeypatch.setattr(worker, "claim", claim)


async def test_a_restored_record_is_claimed_only_past_the_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    app, worker, seen = _attached("environment", monkeypatch)
    claims = _Claims()
    _with_claims(worker, monkeypatch, claims)
    worker.marks.mark("old", 1)
    worker.restorable.update({"old-a1", "new-a2"})
    async with _client(app) as http:
        refused = await http.post("/run", content=orjson.dumps({"episode_id": {"rollout_id": "old", "attempt": 1}}))
        first = await http.post("/run", content=orjson.dumps({"episode_id": {"rollout_id": "new", "attempt": 2}}))
    assert refused.status_code == 409 and first.status_code == 200
    assert [(e.rollout_id, e.attempt) for e in claims.claimed] == [("new", 2)]
    assert worker.restorable == {"old-a1"} and len(seen) == 1


async def test_a_claim_taken_by_another_worker_refuses_except_on_a_model(monkeypatch: pytest.MonkeyPatch) -> None:
    for kind, expected in (("environment", 409), ("model", 200)):
        app, worker, seen = _attached(kind, monkeypatch)
        _with_claims(worker, monkeypatch, _Claims(AttemptRunning("claimed by worker 2", rollout_id="m", attempt=1)))
        worker.restorable.add("m-a1")
        async with _client(app) as http:
            reply = await http.post("/ng-rollout/m-a1/verify", content=b"{}")
        assert reply.status_code == expected, kind
        assert len(seen) == (1 if expected == 200 else 0)


async def test_buffer_body_replays_a_one_message_body_then_the_live_channel() -> None:
    sent = [{"type": "http.request", "body": b"whole", "more_body": False}, {"type": "http.disconnect"}]

    async def receive() -> Any:
        return sent.pop(0)

    body, replay = await buffer_body(receive)
    assert body == b"whole"
    assert await replay() == {"type": "http.request", "body": b"whole", "more_body": False}
    assert await replay() == {"type": "http.disconnect"}


async def test_buffer_body_joins_chunks_and_keeps_an_early_disconnect() -> None:
    chunks = [
        {"type": "http.request", "body": b"a", "more_body": True},
        {"type": "http.request", "body": b"b", "more_body": False},
    ]
    pending = list(chunks)

    async def receive() -> Any:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    body, replay = await buffer_body(receive)
    assert body == b"ab"
    assert [await replay(), await replay(), await replay()] == [*chunks, {"type": "http.disconnect"}]

    async def gone() -> Any:
        return {"type": "http.disconnect"}

    body, replay = await buffer_body(gone)
    assert body == b"" and await replay() == {"type": "http.disconnect"}


async def test_with_marks_an_environment_run_body_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # The usual body: decode_attributed's one parse attributes it; neither the explicit-id scan nor the
    # gate's parse runs. An explicit "<id>-aN" still goes the decoding's way and is judged as decoded.
    from nemo_gym_checkpoint_plugin import _explicit_ids, _gate

    scans: list[bytes] = []
    parses: list[bytes] = []
    real_scan, real_parse = _explicit_ids.decode_run_body, _gate.attempt_from_run_body
    monkeypatch.setattr(_explicit_ids, "decode_run_body", lambda body: scans.append(body) or real_scan(body))
    monkeypatch.setattr(_gate, "attempt_from_run_body", lambda body: parses.append(body) or real_parse(body))
    app, worker, seen = _attached("environment", monkeypatch)
    worker.marks.mark("gone", 3)
    usual_live = orjson.dumps({"episode_id": {"rollout_id": "live", "attempt": 0}, "task": {"x": "-a1"}})
    usual_gone = orjson.dumps({"episode_id": {"rollout_id": "gone", "attempt": 3}})
    explicit_gone = orjson.dumps({"episode_id": {"rollout_id": "gone-a2"}})
    async with _client(app) as http:
        assert (await http.post("/run", content=usual_live)).status_code == 200
        refused = await http.post("/run", content=usual_gone)
        assert scans == [] and parses == []
        explicit = await http.post("/run", content=explicit_gone)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "stale_attempt"
    assert explicit.status_code == 409 and scans == [explicit_gone]  # decoded to gone/2: retired
    assert seen == [("/run", usual_live)] and worker.gate.refused == 2


async def test_decode_attributed_records_the_pair_and_leaves_other_bodies_to_the_decoding() -> None:
    from nemo_gym_checkpoint_plugin._explicit_ids import decode_attributed
    from nemo_gym_checkpoint_plugin._gate import RUN_ATTEMPT, RUN_BODY

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def run(body: bytes) -> tuple[Any, bytes | None]:
        async def receive() -> Any:
            return {"type": "http.request", "body": body, "more_body": False}

        scope: dict[str, Any] = {"type": "http", "method": "POST", "path": "/run", "headers": []}
        decoded = await decode_attributed(scope, receive, send)
        if decoded is None:
            return None, None
        message = await decoded[1]()
        return decoded[0], message["body"]

    plain = orjson.dumps({"episode_id": {"rollout_id": "my-app", "attempt": 2}})
    scope, body = await run(plain)
    assert scope[RUN_ATTEMPT] == ("my-app", 2) and scope[RUN_BODY] == plain and body == plain
    explicit = orjson.dumps({"episode_id": {"rollout_id": "r-a4", "attempt": 0}, "k": 1})
    scope, body = await run(explicit)
    assert RUN_ATTEMPT not in scope and body == orjson.dumps({"episode_id": {"rollout_id": "r", "attempt": 4}, "k": 1})
    scope, _ = await run(orjson.dumps({"episode_id": {"rollout_id": "r-a4", "attempt": 1}}))
    assert scope is None and sent[0]["status"] == 422
    odd = orjson.dumps({"episode_id": {"rollout_id": "r", "attempt": 1, "extra": True}})
    scope, body = await run(odd)
    assert RUN_ATTEMPT not in scope and body == odd  # not the usual shape: the gate parses it as before
