"""The worker link (``_workers/link.py``): faithful messages, typed errors, never a hang."""

from __future__ import annotations

import asyncio
import datetime
import math
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_checkpoint_plugin._errors import StaleAttempt
from nemo_gym_checkpoint_plugin._workers.link import (
    Link,
    LinkClosed,
    LinkRemoteError,
    LinkTimeout,
    MessageRefused,
    connect,
    serve,
)

# Generous against a loaded machine, yet far below the test's own timeout: a hang would show as a failure.
TIMEOUT = 2.0


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="lnk", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Pair:
    """A coordinator-side server and one connected worker link, both closed at the end."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.accepted: list[Link] = []
        self.worker: Link | None = None

    async def aclose(self) -> None:
        links = [*self.accepted, *([self.worker] if self.worker else [])]
        await asyncio.gather(*(link.aclose() for link in links))
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def _echo(_link: Link, op: str, body: Any) -> Any:
    if op == "refuse":
        raise StaleAttempt(f"attempt {body} is retired")
    if op == "crash":
        raise RuntimeError("handler bug")
    if op == "unencodable":
        return {"when": datetime.datetime(2026, 1, 1)}
    if op == "slow":
        await asyncio.sleep(body)  # wait-ok: the handler's own work, not a test wait
    return {"op": op, "body": body}


@pytest.fixture
async def pair(sock_dir: Path) -> AsyncIterator[Pair]:
    made = Pair()
    made.server = await serve(str(sock_dir / "c.sock"), made.accepted.append, handler=_echo)
    made.worker = await connect(str(sock_dir / "c.sock"), timeout=TIMEOUT, handler=_echo, name="coordinator")
    yield made
    await made.aclose()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


async def _accepted(pair: Pair) -> Link:
    deadline = time.monotonic() + TIMEOUT
    while not pair.accepted:
        assert time.monotonic() < deadline, "the server never accepted the worker's connection"
        await asyncio.sleep(0.01)  # wait-ok: poll of a bounded wait on a condition
    return pair.accepted[0]


async def test_values_orjson_would_change_arrive_unchanged_both_ways(pair: Pair) -> None:
    assert pair.worker is not None
    body = {
        "z_first": 1,
        "nan": math.nan,
        "inf": math.inf,
        "ninf": -math.inf,
        "negzero": -0.0,
        "big": 2**200,
        "negbig": -(2**70),
        "u64max_plus": 2**64,
        "list": [math.nan, 1.5, 2**65, "x", None, True],
        "nested": {"b": 2, "a": [{"inf": -math.inf}]},
        "text": "ünïcode \u2028",
    }
    reply = await pair.worker.call("echo", body, timeout=TIMEOUT)
    assert _same(reply, {"op": "echo", "body": body})
    coordinator_side = await _accepted(pair)
    back = await coordinator_side.call("echo", body, timeout=TIMEOUT)
    assert _same(back["body"], body)


async def test_concurrent_calls_get_their_own_replies(pair: Pair) -> None:
    assert pair.worker is not None
    # The slowest first: replies come back out of order and each finds its own call.
    calls = [pair.worker.call("slow", delay, timeout=TIMEOUT) for delay in (0.3, 0.0, 0.1)]
    replies = await asyncio.gather(*calls)
    assert [reply["body"] for reply in replies] == [0.3, 0.0, 0.1]


async def test_a_protocol_refusal_crosses_the_link_typed(pair: Pair) -> None:
    assert pair.worker is not None
    with pytest.raises(StaleAttempt, match="attempt r-a2 is retired") as caught:
        await pair.worker.call("refuse", "r-a2", timeout=TIMEOUT)
    assert caught.value.wire_body["error"]["code"] == "stale_attempt"  # type: ignore[attr-defined]


async def test_a_failing_handler_is_a_remote_error_and_the_link_stays_up(pair: Pair) -> None:
    assert pair.worker is not None
    with pytest.raises(LinkRemoteError, match="handler bug") as caught:
        await pair.worker.call("crash", None, timeout=TIMEOUT)
    assert caught.value.code == "worker_link_error"
    with pytest.raises(LinkRemoteError, match="not a JSON value"):
        await pair.worker.call("unencodable", None, timeout=TIMEOUT)
    assert (await pair.worker.call("echo", 1, timeout=TIMEOUT))["body"] == 1


async def test_a_message_that_is_not_json_or_too_large_is_refused_before_sending(pair: Pair, sock_dir: Path) -> None:
    assert pair.worker is not None
    with pytest.raises(MessageRefused, match="not a plain JSON message"):
        await pair.worker.call("echo", {"s": {1, 2}}, timeout=TIMEOUT)
    reader, writer = await asyncio.open_unix_connection(str(sock_dir / "c.sock"))
    small = Link(reader, writer, name="small", max_frame=64)
    try:
        with pytest.raises(MessageRefused, match="over the 64-byte frame limit"):
            await small.call("echo", "x" * 100, timeout=TIMEOUT)
        assert not small.closed
        assert (await small.call("echo", "ok", timeout=TIMEOUT))["body"] == "ok"
    finally:
        await small.aclose()


async def _silent_peer(sock_dir: Path, behaviour: str) -> tuple[asyncio.Server, list[asyncio.StreamWriter]]:
    """A raw socket peer that reads requests and never answers (``silent``) or hangs up after one (``hangup``)."""
    writers: list[asyncio.StreamWriter] = []

    async def _accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        if behaviour == "deaf":
            return  # never reads: the caller's send buffer fills up
        try:
            await reader.readexactly(4)
        except asyncio.IncompleteReadError:
            return
        if behaviour == "hangup":
            writer.close()
            return
        await reader.read()  # silent: keep reading, never reply

    server = await asyncio.start_unix_server(_accepted, path=str(sock_dir / f"{behaviour}.sock"))
    return server, writers


async def _closed(server: asyncio.Server, writers: list[asyncio.StreamWriter], *links: Link) -> None:
    for link in links:
        await link.aclose()
    for writer in writers:
        writer.close()
    server.close()
    await server.wait_closed()


async def test_a_peer_that_never_answers_is_a_timeout_not_a_hang(sock_dir: Path) -> None:
    server, writers = await _silent_peer(sock_dir, "silent")
    link = await connect(str(sock_dir / "silent.sock"), timeout=TIMEOUT, name="worker 4242")
    try:
        started = time.monotonic()
        with pytest.raises(LinkTimeout, match="worker 4242 did not answer prepare within 0.5 s") as caught:
            await link.call("prepare", {"checkpoint_id": "c1"}, timeout=0.5)
        assert time.monotonic() - started < TIMEOUT
        assert (caught.value.peer, caught.value.op) == ("worker 4242", "prepare")
        assert not link.closed  # a late reply is dropped; the link itself is still up
    finally:
        await _closed(server, writers, link)


async def test_a_peer_that_never_reads_is_a_timeout_while_sending(sock_dir: Path) -> None:
    server, writers = await _silent_peer(sock_dir, "deaf")
    link = await connect(str(sock_dir / "deaf.sock"), timeout=TIMEOUT, name="deaf worker")
    try:
        # Far more than the socket buffers hold: drain() waits for a reader that never comes.
        with pytest.raises(LinkTimeout, match="deaf worker did not answer export"):
            await link.call("export", "x" * (32 * 1024 * 1024), timeout=0.5)
    finally:
        await _closed(server, writers, link)


async def test_a_peer_that_disconnects_fails_the_call_at_once(sock_dir: Path) -> None:
    server, writers = await _silent_peer(sock_dir, "hangup")
    link = await connect(str(sock_dir / "hangup.sock"), timeout=TIMEOUT, name="worker 7")
    seen: list[Link] = []
    link.on_close(seen.append)
    try:
        started = time.monotonic()
        with pytest.raises(LinkClosed, match="worker 7"):
            await link.call("ready", None, timeout=30.0)
        assert time.monotonic() - started < TIMEOUT  # not the 30 s timeout: the hang-up itself
        assert link.closed and seen == [link]
        with pytest.raises(LinkClosed, match="is closed"):
            await link.call("ready", None, timeout=30.0)
        late: list[Link] = []
        link.on_close(late.append)
        assert late == [link]
    finally:
        await _closed(server, writers, link)


async def test_every_waiting_call_fails_when_the_link_closes(pair: Pair) -> None:
    assert pair.worker is not None
    waiting = [asyncio.ensure_future(pair.worker.call("slow", 5.0, timeout=30.0)) for _ in range(3)]
    coordinator_side = await _accepted(pair)
    await coordinator_side.aclose()
    results = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), TIMEOUT)
    assert all(isinstance(result, LinkClosed) for result in results), results
    await pair.worker.wait_closed()
    assert pair.worker.closed


async def test_a_frame_over_the_limit_from_the_peer_closes_the_link(sock_dir: Path) -> None:
    accepted: list[Link] = []
    server = await serve(str(sock_dir / "c.sock"), accepted.append, handler=_echo, max_frame=64)
    reader, writer = await asyncio.open_unix_connection(str(sock_dir / "c.sock"))
    try:
        writer.write((1 << 30).to_bytes(4, "big"))  # claims a 1 GiB frame
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""  # the server hung up
        assert accepted and "over the 64-byte limit" in (accepted[0].close_reason or "")
    finally:
        writer.close()
        for link in accepted:
            await link.aclose()
        server.close()
        await server.wait_closed()


async def test_connecting_to_nothing_is_a_typed_error(sock_dir: Path) -> None:
    with pytest.raises(LinkClosed, match="cannot connect to coordinator"):
        await connect(str(sock_dir / "nobody.sock"), timeout=TIMEOUT)


async def test_a_call_needs_a_positive_timeout(pair: Pair) -> None:
    assert pair.worker is not None
    for bad in (0, -1, math.nan):
        with pytest.raises(ValueError, match="positive timeout"):
            await pair.worker.call("echo", None, timeout=bad)
