"""Control requests on a worker's port answered by the coordinator's plane (``_workers/forward.py``), real socket.

A worker's ``ForwardControl`` in front of an app that must never see a control request; the
coordinator of ``workers_support.Cluster`` serves the plane's control routes. The answers are the
plane's own: bearer check, status, a body over the limit refused from its header, and a 503
``coordinator_unreachable`` when the worker has no coordinator.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from workers_support import Cluster

from nemo_gym_checkpoint_plugin._routes import attach as attach_routes
from nemo_gym_checkpoint_plugin._workers.forward import ForwardControl

TOKEN = "forward-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STATUS = "/ng-control/v1/checkpoint/status"


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    made = Cluster(2)
    control_app = FastAPI()
    attach_routes(control_app, made.plane, TOKEN)
    made.coordinator.control_app = control_app
    try:
        await made.start(101, 102)
        yield made
    finally:
        await made.aclose()


async def _data_app(scope: Any, receive: Any, send: Any) -> None:
    assert not scope["path"].startswith("/ng-control"), "a control request reached the worker's own app"
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def _client(link: Any) -> httpx.AsyncClient:
    app = ForwardControl(_data_app, link=lambda: link)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker", timeout=10.0)


async def test_a_control_request_on_a_worker_is_answered_by_the_coordinators_plane(cluster: Cluster) -> None:
    async with _client(cluster.workers[101].link) as http:
        assert (await http.get(STATUS)).status_code == 401
        status = await http.get(STATUS, headers=AUTH)
        assert status.status_code == 200, status.text
        assert status.json()["workers"]["connected"] == ["worker 101", "worker 102"]
        prepared = await http.post(
            "/ng-control/v1/checkpoint/prepare",
            headers=AUTH,
            json={"checkpoint_id": "f1", "deadline_ts": time.time() + 10},
        )
        assert prepared.json()["phase"] == "prepared", prepared.text
        assert not cluster.workers[102].admission.is_open  # the coordinator closed every worker
        too_big = await http.post(
            "/ng-control/v1/checkpoint/resume", headers={**AUTH, "Content-Length": str(65 * 1024 * 1024)}, content=b""
        )
        assert too_big.status_code == 413, too_big.text
        resumed = await http.post(
            "/ng-control/v1/checkpoint/resume",
            headers=AUTH,
            json={"checkpoint_id": "f1", "deadline_ts": time.time() + 10},
        )
        assert resumed.json()["phase"] == "idle"
        assert (await http.get("/data")).status_code == 204  # anything else is the worker's own


async def test_a_worker_without_its_coordinator_answers_503_coordinator_unreachable() -> None:
    async with _client(None) as http:
        reply = await http.get(STATUS, headers=AUTH)
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "coordinator_unreachable"
