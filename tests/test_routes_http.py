"""The control routes on the wire: bearer auth, strict bodies, the status reply, attach()."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from control_support import AUTH, INSTANCE, KIND, TOKEN, Harness, close_harness, deadline, make_harness, wire
from fastapi import FastAPI

from nemo_gym_checkpoint_plugin._errors import StaleCheckpoint
from nemo_gym_checkpoint_plugin._routes import CONTROL_PREFIX, attach, make_router

ROUTES: dict[str, dict[str, Any]] = {
    "prepare": {"checkpoint_id": "c1"},
    "renew": {"checkpoint_id": "c1"},
    "resume": {"checkpoint_id": "c1"},
    "commit": {"checkpoint_id": "c1", "checkpoint_dir": "/tmp/x", "episode_ids": None},
    "restore": {"checkpoint_id": "c1", "checkpoint_dir": "/tmp/x", "episode_ids": []},
    "retire": {"checkpoint_id": "c1", "episode_ids": [wire("r1")]},
    "forget": {"checkpoint_id": "c1", "rollout_ids": ["r1"]},
}


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await make_harness(tmp_path)
    yield harness
    await close_harness(harness)


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": TOKEN},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": f"Bearer {TOKEN[:-1]}"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": f"Bearers {TOKEN}"},
        {"Authorization": f"bearer{TOKEN}"},
        {"Authorization": f"bearer {TOKEN.upper()}"},
        {"Authorization": "Bearer"},
    ],
)
async def test_every_route_refuses_a_missing_or_wrong_token(h: Harness, headers: dict[str, str]) -> None:
    response = await h.client.get(f"{CONTROL_PREFIX}/status", headers=headers)
    assert response.status_code == 401 and response.json()["error"]["code"] == "unauthorized"
    for route, body in ROUTES.items():
        response = await h.post(route, {**body, "deadline_ts": deadline()}, headers=headers)
        assert response.status_code == 401, route
        assert response.json() == {"error": {"code": "unauthorized", "detail": "missing or wrong bearer token"}}
    # Nothing reached the control plane.
    assert h.plane.phase == "idle" and h.participant.calls == [] and len(h.plane.marks) == 0


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "bEaReR", "Bearer"])
async def test_the_scheme_is_case_insensitive(h: Harness, scheme: str) -> None:
    # RFC 7235: auth schemes are case-insensitive; the token itself is not.
    headers = {"Authorization": f"{scheme} {TOKEN}"}
    assert (await h.client.get(f"{CONTROL_PREFIX}/status", headers=headers)).status_code == 200
    response = await h.post("prepare", {"checkpoint_id": "c1", "deadline_ts": deadline()}, headers=headers)
    assert response.status_code == 200 and response.json()["phase"] == "prepared"
    wrong = await h.post(
        "resume", {"checkpoint_id": "c1", "deadline_ts": deadline()}, headers={"Authorization": f"{scheme} {TOKEN}x"}
    )
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorized"


def test_the_token_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import hmac

    from nemo_gym_checkpoint_plugin import _routes as routes

    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(routes.hmac, "compare_digest", spy)
    assert routes._authorized(f"bearer {TOKEN}", TOKEN.encode())
    # Even with a wrong scheme the token goes through compare_digest: no early exit to time.
    assert not routes._authorized(f"Basic {TOKEN}", TOKEN.encode())
    assert compared == [(TOKEN.encode(), TOKEN.encode())] * 2


async def test_the_token_is_checked_before_the_body_is_read(h: Harness) -> None:
    response = await h.client.post(
        f"{CONTROL_PREFIX}/prepare",
        content=b"{not json",
        headers={"Authorization": "Bearer nope", "content-type": "application/json"},
    )
    assert response.status_code == 401


@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_unknown_fields_are_refused(h: Harness, route: str) -> None:
    response = await h.post(route, {**ROUTES[route], "deadline_ts": deadline(), "surprise": 1})
    assert response.status_code == 422
    assert h.participant.calls == []


@pytest.mark.parametrize("checkpoint_id", ["", "-leading-dash", ".hidden", "a/b", "a b", "x" * 129, "é", 7, None])
async def test_checkpoint_id_pattern_and_length(h: Harness, checkpoint_id: Any) -> None:
    response = await h.post("prepare", {"checkpoint_id": checkpoint_id, "deadline_ts": deadline()})
    assert response.status_code == 422


async def test_the_longest_checkpoint_id_is_accepted(h: Harness) -> None:
    assert (await h.call("prepare", checkpoint_id="A" + "._-9" * 31 + "zzz"))["phase"] == "prepared"


@pytest.mark.parametrize("deadline_ts", ["1e12", True, None, "inf", [1]])
async def test_deadline_must_be_a_number(h: Harness, deadline_ts: Any) -> None:
    response = await h.post("prepare", {"checkpoint_id": "c1", "deadline_ts": deadline_ts})
    assert response.status_code == 422


@pytest.mark.parametrize("raw", [b"Infinity", b"NaN", b"-Infinity", b"1e999"])
async def test_deadline_must_be_finite(h: Harness, raw: bytes) -> None:
    body = b'{"checkpoint_id": "c1", "deadline_ts": ' + raw + b"}"
    response = await h.client.post(
        f"{CONTROL_PREFIX}/prepare", content=body, headers={**AUTH, "content-type": "application/json"}
    )
    assert response.status_code == 422, (raw, response.text)
    assert h.plane.phase == "idle"


@pytest.mark.parametrize("raw", [b"\x80", b"{not json", b"", b"[]", b"null"])
async def test_undecodable_bodies_are_422(h: Harness, raw: bytes) -> None:
    response = await h.client.post(
        f"{CONTROL_PREFIX}/prepare", content=raw, headers={**AUTH, "content-type": "application/json"}
    )
    assert response.status_code == 422, response.text


async def test_an_integer_deadline_is_a_deadline(h: Harness) -> None:
    assert (await h.call("prepare", checkpoint_id="c1", deadline_ts=math.floor(deadline())))["phase"] == "prepared"


@pytest.mark.parametrize(
    ("route", "field", "value"),
    [
        ("retire", "episode_ids", []),
        ("forget", "rollout_ids", []),
        ("retire", "episode_ids", [{"rollout_id": "r1-a2", "attempt": 1}]),
        ("retire", "episode_ids", [{"rollout_id": "r1", "attempt": -1}]),
        ("retire", "episode_ids", [{"rollout_id": "r1", "attempt": 0, "extra": 1}]),
        ("restore", "episode_ids", None),
        ("commit", "stop", "yes"),
        ("commit", "checkpoint_dir", ""),
        ("commit", "checkpoint_dir", "relative/dir"),
        ("restore", "checkpoint_dir", "/tmp/with\x00nul"),
        ("commit", "checkpoint_dir", "s3://AKIAKEYID:s3cr3tvalue@bucket/run"),
        ("restore", "checkpoint_dir", "s3://bucket/run?versionId=1"),
        ("restore", "checkpoint_dir", "s3://"),
    ],
)
async def test_episode_lists_and_fields_are_validated(h: Harness, route: str, field: str, value: Any) -> None:
    response = await h.post(route, {**ROUTES[route], field: value, "deadline_ts": deadline()})
    assert response.status_code == 422
    assert "s3cr3tvalue" not in response.text  # a credential in a URL is refused, never repeated
    assert len(h.plane.marks) == 0


async def test_status_reply(h: Harness) -> None:
    h.participant.add("r1", "r2")
    h.participant.blockers = {"r2"}
    h.participant.restarts = {"r1"}
    body = await h.status()
    assert body == {
        "kind": KIND,
        "instance": INSTANCE,
        "phase": "idle",
        "checkpoint_id": None,
        "lease_expires_at": None,
        "retired_rollouts": 0,
        "retired_marks": {},
        "report": {
            "ready": False,
            "blockers": ["r2"],
            "blocker_count": 1,
            "counts": {"episodes": 2},
            "restarts": ["r1"],
        },
        "held_episodes": 2,  # hook status_fields: a participant field; its "kind" did not replace ours
    }


async def test_hook_status_fields_are_merged_into_status(h: Harness) -> None:
    assert (await h.status())["held_episodes"] == 0
    assert "status_fields" in h.recorder.names


async def test_attach_installs_router_and_error_handler() -> None:
    class Plane:  # attach only needs an object to route to
        async def status(self) -> dict[str, Any]:
            return {"phase": "stub"}

        def admit_owner(self, owner: str | None, operation: str, deadline_ts: float, take_over: bool) -> None:
            return None  # nobody owns a stub

        async def prepare(self, checkpoint_id: str, deadline_ts: float) -> dict[str, Any]:
            raise StaleCheckpoint(f"{checkpoint_id} was resumed")

    app = FastAPI()
    attach(app, Plane(), TOKEN)  # type: ignore[arg-type]
    assert isinstance(app.state.checkpoint_control, Plane)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        assert (await client.get(f"{CONTROL_PREFIX}/status", headers=AUTH)).json() == {"phase": "stub"}
        response = await client.post(
            f"{CONTROL_PREFIX}/prepare", headers=AUTH, json={"checkpoint_id": "c1", "deadline_ts": deadline()}
        )
        assert response.status_code == 409
        assert response.json() == {"error": {"code": "stale_checkpoint", "detail": "c1 was resumed"}}
    with pytest.raises(ValueError, match="non-empty"):
        make_router(Plane(), "")  # type: ignore[arg-type]
