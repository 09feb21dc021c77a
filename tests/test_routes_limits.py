"""Body limits of the control routes, and bodies parsed and validated off the event loop.

Documented in docs/protocol.md "Routes": a body over ``BodyLimits.max_body_bytes``
(64 MiB) is a 413, refused from ``Content-Length`` before it is read or while it streams in;
a list over ``BodyLimits.max_ids`` (200,000) is a 422. Validation runs in a worker thread, so
the server answers other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from control_support import AUTH, Harness, close_harness, deadline, make_harness, wait_until, wire
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from nemo_gym_checkpoint_plugin._control import bodies
from nemo_gym_checkpoint_plugin._identity import capture_key
from nemo_gym_checkpoint_plugin._routes import CONTROL_PREFIX, BodyLimits, RetireBody

SMALL = BodyLimits(max_body_bytes=2_000, max_ids=5)


@pytest.fixture
async def small(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await make_harness(tmp_path, limits=SMALL)
    yield harness
    await close_harness(harness)


def test_the_documented_defaults() -> None:
    assert BodyLimits().max_body_bytes == 64 * 1024 * 1024
    assert BodyLimits().max_ids == 200_000


def ids_body(n: int, **extra: Any) -> dict[str, Any]:
    # A generous deadline: this is about the loop staying free, not about speed on a loaded machine.
    return {
        "checkpoint_id": "c1",
        "deadline_ts": deadline(300),
        "episode_ids": [{"rollout_id": f"rollout-{i:07d}", "attempt": i % 3} for i in range(n)],
        **extra,
    }


async def test_a_retire_at_the_id_limit_is_validated_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = await make_harness(tmp_path)
    limit = BodyLimits().max_ids
    validating = threading.Event()
    answered = threading.Event()
    real = bodies.validate_body

    def held(*args: Any) -> Any:
        # Holds the validation until another request was answered: if validation ran on the event
        # loop, nothing else could be answered and this wait would time out.
        validating.set()
        assert answered.wait(30), "no other request was answered while the body was being validated"
        return real(*args)

    monkeypatch.setattr(bodies, "validate_body", held)
    try:
        content = orjson.dumps(ids_body(limit))
        retire = asyncio.create_task(
            h.client.post(
                f"{CONTROL_PREFIX}/retire", content=content, headers={**AUTH, "content-type": "application/json"}
            )
        )
        await wait_until(validating.is_set, timeout=30, what="the retire's validation to start")
        assert (await h.status())["phase"] == "idle"
        assert not retire.done()
        answered.set()
        response = await retire
        assert response.status_code == 200 and response.json() == {"retired_count": limit}
        assert len(h.plane.marks) == limit
    finally:
        answered.set()
        await close_harness(h)


@pytest.mark.parametrize(
    ("route", "field", "extra"),
    [
        ("retire", "episode_ids", {}),
        ("restore", "episode_ids", {"checkpoint_dir": "/tmp/x"}),
        ("commit", "episode_ids", {"checkpoint_dir": "/tmp/x"}),
        ("forget", "rollout_ids", {}),
    ],
)
async def test_a_list_over_the_id_limit_is_422_and_changes_nothing(
    small: Harness, route: str, field: str, extra: dict[str, Any]
) -> None:
    items: list[Any] = [wire(f"r{i}") for i in range(SMALL.max_ids + 1)]
    if field == "rollout_ids":
        items = [f"r{i}" for i in range(SMALL.max_ids + 1)]
    response = await small.post(route, {"checkpoint_id": "c1", "deadline_ts": deadline(), field: items, **extra})
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["type"] == "too_long" and error["loc"] == ["body", field]
    assert small.plane.phase == "idle" and small.participant.calls == [] and len(small.plane.marks) == 0
    # At the limit the body is accepted (the plane may still refuse the call, e.g. nothing to restore).
    response = await small.post(
        route, {"checkpoint_id": "c1", "deadline_ts": deadline(), field: items[: SMALL.max_ids], **extra}
    )
    assert "detail" not in response.json(), response.text


async def test_a_declared_length_over_the_limit_is_413_before_the_body_is_read(small: Harness) -> None:
    received: list[Any] = []
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        received.append(1)
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": f"{CONTROL_PREFIX}/retire",
        "raw_path": f"{CONTROL_PREFIX}/retire".encode(),
        "query_string": b"",
        "root_path": "",
        "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 1),
        "headers": [
            (b"authorization", AUTH["Authorization"].encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(10**12).encode()),
        ],
    }
    await small.app(scope, receive, send)
    assert sent[0]["status"] == 413 and received == []
    assert json.loads(sent[1]["body"])["detail"][0]["type"] == "body_too_large"


async def test_a_streamed_body_over_the_limit_is_413_without_reading_it_all(small: Harness) -> None:
    chunks: list[int] = []

    async def endless() -> AsyncIterator[bytes]:
        for n in range(1000):
            chunks.append(n)
            yield b" " * 500

    response = await small.client.post(
        f"{CONTROL_PREFIX}/retire", content=endless(), headers={**AUTH, "content-type": "application/json"}
    )
    assert response.status_code == 413 and response.json()["detail"][0]["type"] == "body_too_large"
    assert len(chunks) <= SMALL.max_body_bytes // 500 + 2
    assert small.plane.phase == "idle" and len(small.plane.marks) == 0


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "latin-1"])
async def test_bodies_that_are_not_utf8_json_are_422(small: Harness, encoding: str) -> None:
    text = json.dumps(
        {"checkpoint_id": "c1", "deadline_ts": deadline(), "rollout_ids": ["r\u00e9"]}, ensure_ascii=False
    )
    response = await small.client.post(
        f"{CONTROL_PREFIX}/forget", content=text.encode(encoding), headers={**AUTH, "content-type": "application/json"}
    )
    assert response.status_code == 422 and response.json()["detail"][0]["type"] == "json_invalid"
    assert small.participant.calls == []


async def test_item_errors_are_capped(small: Harness) -> None:
    response = await small.post(
        "retire",
        {"checkpoint_id": "c1", "deadline_ts": deadline(), "episode_ids": [{"rollout_id": "-bad"}] * SMALL.max_ids},
    )
    assert response.status_code == 422
    assert {e["loc"][1] for e in response.json()["detail"]} == {"episode_ids"}


async def test_a_large_commit_scope_commits(tmp_path: Path) -> None:
    # Issue 14's scale: 16,000 episodes in one commit scope.
    h = await make_harness(tmp_path)
    try:
        h.participant.add("rollout-0000003", "rollout-0000001-a1", "rollout-9999999")
        await h.call("prepare", checkpoint_id="c1")
        reply = await h.call("commit", **ids_body(16_000, checkpoint_dir=str(tmp_path / "ckpt")))
        assert reply["episode_ids"] == ["rollout-0000001-a1", "rollout-0000003"]
        assert len(h.participant.called("export")[0]["scope"]) == 16_000
    finally:
        await close_harness(h)


# -- the bulk checks accept exactly what the pydantic model accepts ------------------------------------

items = st.one_of(
    st.fixed_dictionaries(
        {
            "rollout_id": st.one_of(
                st.sampled_from(["r1", "r1-a2", "r-a0", "r-a01", "a.b_c-d", "-x", "é", "r\n"]),
                st.text(max_size=6),
                st.integers(-(2**63), 2**63 - 1),
            )
        },
        optional={
            "attempt": st.one_of(st.integers(-2, 2**63 - 1), st.booleans(), st.sampled_from(["1", 1.0, 1.5, None])),
            "other": st.just(1),
        },
    ),
    st.text(max_size=3),
    st.integers(0, 2**63 - 1),
    st.none(),
    st.lists(st.integers(0, 9), max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(episode_ids=st.lists(items, max_size=4))
def test_bulk_validation_matches_the_model(episode_ids: list[Any]) -> None:
    data = {"checkpoint_id": "c1", "deadline_ts": 1.0, "episode_ids": episode_ids}
    try:
        expected = RetireBody.model_validate(data)
    except ValidationError:
        expected = None
    try:
        got = bodies.validate_body(orjson.dumps(data), RetireBody, *_retire_parsing(), BodyLimits())
    except bodies.BodyRefused as exc:
        assert expected is None, (episode_ids, exc.errors)
        return
    assert expected is not None, episode_ids
    assert list(got.episode_ids) == list(expected.episode_ids)
    assert got.episode_ids.sorted_capture_keys == tuple(sorted({e.capture_key for e in expected.episode_ids}))


plain_ids = st.one_of(
    st.sampled_from(["r1", "r1-a2", "r-a0", "r-a01", "a.b_c-d", "-x", "é", "r\n", "a\nb", "", "x-a1\ny", "r-a"]),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,6}(-a[0-9]{1,2})?", fullmatch=True),
)
plain_items = st.fixed_dictionaries(
    {"rollout_id": plain_ids}, optional={"attempt": st.one_of(st.integers(-1, 5), st.just(True))}
)


@settings(max_examples=300, deadline=None)
@given(episode_ids=st.lists(plain_items, min_size=1, max_size=6))
def test_the_whole_list_check_takes_exactly_what_the_model_takes(episode_ids: list[Any]) -> None:
    """The fast path over a whole list (one regular expression over the joined ids) accepts a list only
    when the model accepts every item unchanged, with the same pairs and keys."""
    try:
        expected = [
            (e.rollout_id, e.attempt)
            for e in RetireBody.model_validate(
                {"checkpoint_id": "c1", "deadline_ts": 1.0, "episode_ids": episode_ids}
            ).episode_ids
        ]
    except ValidationError:
        expected = None
    got = bodies._plain_episodes(episode_ids)
    exact = expected is not None and all(
        type(item.get("attempt", 0)) is int and item["rollout_id"] == rollout_id
        for item, (rollout_id, _) in zip(episode_ids, expected, strict=True)
    )
    if got is None:
        assert not exact, f"a list the model takes unchanged went the slow way: {episode_ids}"
        return
    assert expected is not None, f"accepted what the model refuses: {episode_ids}"
    assert got.pairs == expected
    assert got.sorted_capture_keys == tuple(sorted({capture_key(r, a) for r, a in expected}))


@pytest.mark.parametrize("number", [b"36893488147419103232", b"-36893488147419103232", b"1e400"])
async def test_numbers_beyond_64_bits_are_never_a_500(small: Harness, number: bytes) -> None:
    # orjson reads integers beyond 64 bits as floats; whatever they become, never a 500.
    for route, body in [
        ("retire", b'{"checkpoint_id":"c1","deadline_ts":1e10,"episode_ids":[{"rollout_id":"r1","attempt":%s}]}'),
        ("prepare", b'{"checkpoint_id": "c1", "deadline_ts": %s}'),
    ]:
        response = await small.client.post(
            f"{CONTROL_PREFIX}/{route}", content=body % number, headers={**AUTH, "content-type": "application/json"}
        )
        assert response.status_code in (200, 409, 422), (route, response.text)


def _retire_parsing() -> tuple[Any, Any]:
    from nemo_gym_checkpoint_plugin._routes import _PARSING

    return _PARSING[RetireBody]
