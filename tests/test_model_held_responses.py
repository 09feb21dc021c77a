"""The model participant's held responses and retire, driven as raw ASGI (every message observed as it is sent).

A scripted route sends its response messages one at a time, each when the test allows it, so a
test can close admission at any point of a response and see exactly what reached the caller.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from control_support import wait_until
from nemo_gym_checkpoint_plugin.builtin_participants.model.calls import ModelCalls
from nemo_gym_checkpoint_plugin.builtin_participants.model.held_responses import HeldResponses, SSEScan

from nemo_gym_checkpoint_plugin._identity import EpisodeId

START_JSON = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
START_SSE = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
}


def body(data: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


class ScriptedRoute:
    """An ASGI route that sends ``messages`` one by one, each once ``step()`` allows it."""

    def __init__(self, messages: list[dict[str, Any]], *, on_cancel: asyncio.Event | None = None) -> None:
        self.messages = messages
        self.allowed = 0
        self._more = asyncio.Event()
        self.sent = 0
        self.cancelled = False
        self.cleanup_done = False
        self._on_cancel = on_cancel  # when set: cleanup after a cancel waits for it (a slow cleanup)

    def step(self, n: int = 1) -> None:
        self.allowed += n
        self._more.set()

    def all(self) -> None:
        self.step(len(self.messages))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            for message in self.messages:
                while self.allowed <= self.sent:
                    self._more.clear()
                    await self._more.wait()
                await send(message)
                self.sent += 1
        except asyncio.CancelledError:
            self.cancelled = True
            if self._on_cancel is not None:
                await self._on_cancel.wait()
            self.cleanup_done = True
            raise


class Caller:
    """One request through ``HeldResponses``: what reached the caller, in order."""

    def __init__(self, calls: ModelCalls, route: ScriptedRoute, path: str = "/ng-rollout/r1/v1/responses") -> None:
        self.received: list[dict[str, Any]] = []
        self.app = HeldResponses(route, calls=calls)
        scope = {"type": "http", "method": "POST", "path": path, "headers": []}
        self.task = asyncio.ensure_future(self.app(scope, self._receive, self._send))

    async def _receive(self) -> dict[str, Any]:
        await asyncio.Event().wait()  # the client never disconnects on its own
        raise AssertionError("unreachable")

    async def _send(self, message: dict[str, Any]) -> None:
        self.received.append(message)


@pytest.fixture
def calls() -> ModelCalls:
    return ModelCalls()


async def settle() -> None:
    # Lets every ready task run to its next real wait; bounded, no timing involved.
    for _ in range(20):
        await asyncio.sleep(0)  # wait-ok: yields to the loop, no duration stands in for a condition


async def test_open_admission_passes_every_message_unchanged(calls: ModelCalls) -> None:
    messages = [START_JSON, body(b'{"output": 1}')]
    route = ScriptedRoute(messages)
    caller = Caller(calls, route)
    route.all()
    await caller.task
    assert caller.received == messages
    assert calls.in_flight == 0 and calls.served_total == 1 and calls.held_total == 0


async def test_a_response_not_started_is_held_until_resume_and_delivered_unchanged(calls: ModelCalls) -> None:
    messages = [START_JSON, body(b'{"output": "answer"}')]
    route = ScriptedRoute(messages)
    caller = Caller(calls, route)
    await settle()
    calls.close_admission("ck")
    route.all()  # the generation finishes while the checkpoint is open
    await wait_until(lambda: calls.held == 1, what="the response held")
    assert caller.received == []  # not even the status line
    ready = calls.ready(checkpoint_id="ck")
    assert list(ready.blockers) == [] and ready.counts["model_responses_held"] == 1
    calls.open_admission("ck")
    await caller.task
    assert caller.received == messages
    assert calls.held == 0 and calls.held_total == 1


async def test_headers_and_empty_bodies_do_not_start_a_response(calls: ModelCalls) -> None:
    messages = [START_JSON, body(b"", more=True), body(b"", more=True), body(b'{"a": 1}')]
    route = ScriptedRoute(messages)
    caller = Caller(calls, route)
    route.step(3)  # headers and two empty chunks, while admission is open
    await wait_until(lambda: route.sent == 3, what="headers and empty chunks sent by the route")
    calls.close_admission("ck")
    route.step()
    await wait_until(lambda: calls.held == 1, what="the first data held")
    assert caller.received == []
    calls.open_admission("ck")
    await caller.task
    assert caller.received == messages


async def test_sse_keep_alive_comments_pass_while_the_first_data_is_held(calls: ModelCalls) -> None:
    comment = body(b": keep-alive\n\n", more=True)
    data = body(b'data: {"delta": "hi"}\n\n', more=True)
    done = body(b"data: [DONE]\n\n")
    route = ScriptedRoute([START_SSE, comment, comment, data, done])
    caller = Caller(calls, route)
    await settle()
    calls.close_admission("ck")
    route.step(3)
    await wait_until(lambda: len(caller.received) == 3, what="headers and keep-alives delivered")
    assert caller.received == [START_SSE, comment, comment]
    route.step()
    await wait_until(lambda: calls.held == 1, what="the first event held")
    assert len(caller.received) == 3
    calls.open_admission("ck")
    route.step()
    await caller.task
    assert caller.received == [START_SSE, comment, comment, data, done]


async def test_an_event_stream_that_started_finishes_while_admission_is_closed(calls: ModelCalls) -> None:
    messages = [START_SSE, body(b"data: 1\n\n", more=True), body(b"data: 2\n\n", more=True), body(b"")]
    route = ScriptedRoute(messages)
    caller = Caller(calls, route)
    route.step(2)
    await wait_until(lambda: len(caller.received) == 2, what="the stream started")
    calls.close_admission("ck")
    route.all()
    await caller.task  # finishes without any resume
    assert caller.received == messages
    assert calls.held_total == 0


async def test_the_end_of_an_empty_response_is_held(calls: ModelCalls) -> None:
    messages = [{"type": "http.response.start", "status": 204, "headers": []}, body(b"")]
    route = ScriptedRoute(messages)
    caller = Caller(calls, route)
    await settle()
    calls.close_admission("ck")
    route.all()
    await wait_until(lambda: calls.held == 1, what="the empty reply held")
    assert caller.received == []
    calls.open_admission("ck")
    await caller.task
    assert caller.received == messages


async def test_a_wake_into_a_new_checkpoint_holds_on(calls: ModelCalls) -> None:
    route = ScriptedRoute([START_JSON, body(b"{}")])
    caller = Caller(calls, route)
    await settle()
    calls.close_admission("ck-1")
    route.all()
    await wait_until(lambda: calls.held == 1, what="held for ck-1")
    calls.open_admission("ck-1")
    calls.close_admission("ck-2")  # before the held task ran again
    await settle()
    assert caller.received == [] and calls.held == 1
    calls.open_admission("ck-2")
    await caller.task
    assert len(caller.received) == 2


# -- retire ---------------------------------------------------------------------------------------


def _refusal(caller: Caller) -> dict[str, Any]:
    assert caller.received[0]["status"] == 409, caller.received
    return orjson.loads(caller.received[1]["body"])["error"]


async def test_retire_stops_a_running_call_waits_and_refuses_it(calls: ModelCalls) -> None:
    route = ScriptedRoute([START_JSON, body(b"{}")])  # never allowed: still generating
    other_route = ScriptedRoute([START_JSON, body(b"{}")])
    later_route = ScriptedRoute([START_JSON, body(b"{}")])
    caller = Caller(calls, route, "/ng-rollout/r1-a1/v1/responses")
    other = Caller(calls, other_route, "/ng-rollout/r2/v1/responses")
    later = Caller(calls, later_route, "/ng-rollout/r1-a2/v1/responses")
    await settle()
    await calls.retire(episode_ids=[EpisodeId(rollout_id="r1", attempt=1)])
    # Retire returned only once the stopped call ended and its caller was answered.
    assert route.cancelled and caller.task.done()
    error = _refusal(caller)
    assert error["code"] == "stale_attempt"
    assert not other_route.cancelled and not later_route.cancelled
    assert calls.in_flight == 2 and calls.stopped_total == 1
    other_route.all()
    later_route.all()
    await asyncio.gather(other.task, later.task)
    assert other.received[0]["status"] == later.received[0]["status"] == 200


async def test_retire_stops_a_held_response(calls: ModelCalls) -> None:
    route = ScriptedRoute([START_JSON, body(b"{}")])
    caller = Caller(calls, route)
    await settle()
    calls.close_admission("restore-1")
    route.all()
    await wait_until(lambda: calls.held == 1, what="held")
    await calls.retire(episode_ids=[EpisodeId(rollout_id="r1", attempt=0)])
    assert _refusal(caller)["code"] == "stale_attempt"
    assert calls.held == 0 and calls.in_flight == 0


async def test_retire_of_a_started_stream_cuts_it_short(calls: ModelCalls) -> None:
    route = ScriptedRoute([START_SSE, body(b"data: 1\n\n", more=True), body(b"")])
    caller = Caller(calls, route)
    route.step(2)
    await wait_until(lambda: len(caller.received) == 2, what="the stream started")
    await calls.retire(episode_ids=[EpisodeId(rollout_id="r1", attempt=0)])
    assert caller.task.done() and route.cancelled
    assert caller.received == [START_SSE, body(b"data: 1\n\n", more=True)]  # nothing after: no 409 either


async def test_a_retried_retire_waits_without_cancelling_again(calls: ModelCalls) -> None:
    cleanup = asyncio.Event()
    route = ScriptedRoute([START_JSON, body(b"{}")], on_cancel=cleanup)
    caller = Caller(calls, route)
    await settle()
    episode = [EpisodeId(rollout_id="r1", attempt=0)]
    first = asyncio.ensure_future(calls.retire(episode_ids=episode))
    await wait_until(lambda: route.cancelled, what="the first retire cancelled the call")
    second = asyncio.ensure_future(calls.retire(episode_ids=episode))
    await settle()
    assert not first.done() and not second.done()  # both wait for the cleanup
    cleanup.set()
    await asyncio.gather(first, second)
    assert route.cleanup_done  # a second cancel would have interrupted it
    assert calls.stopped_total == 1 and _refusal(caller)["code"] == "stale_attempt"


async def test_a_caller_going_away_is_not_answered(calls: ModelCalls) -> None:
    route = ScriptedRoute([START_JSON, body(b"{}")])
    caller = Caller(calls, route)
    await settle()
    caller.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller.task
    assert route.cancelled and caller.received == [] and calls.in_flight == 0


async def test_unattributed_calls_are_held_but_never_retired(calls: ModelCalls) -> None:
    route = ScriptedRoute([START_JSON, body(b"{}")])
    caller = Caller(calls, route, "/v1/responses")
    await settle()
    calls.close_admission("ck")
    route.all()
    await wait_until(lambda: calls.held == 1, what="held")
    await calls.retire(episode_ids=[EpisodeId(rollout_id="r1", attempt=5)])
    assert not route.cancelled
    calls.open_admission("ck")
    await caller.task
    assert len(caller.received) == 2


async def test_health_and_control_routes_are_never_held(calls: ModelCalls) -> None:
    calls.close_admission("ck")
    for path in ("/", "/health", "/ng-control/v1/checkpoint/status"):
        route = ScriptedRoute([START_JSON, body(b"{}")])
        caller = Caller(calls, route, path)
        route.all()
        await asyncio.wait_for(caller.task, 5)
        assert len(caller.received) == 2
    assert calls.served_total == 0


# -- what counts as answer data in an event stream ------------------------------------------------


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        ([b": keep-alive\n\n"], [False]),
        ([b"\n\r\n\r"], [False]),
        ([b": keep", b"-alive\n\n", b"data: x\n\n"], [False, False, True]),
        ([b": a\r: b\r\n", b"event: done\n"], [False, True]),
        ([b": keep-alive\n\ndata: x"], [True]),
        ([b": no end yet", b" still comment", b"\ndata"], [False, False, True]),
        ([b"id: 1\n"], [True]),
    ],
)
def test_sse_scan(chunks: list[bytes], expected: list[bool]) -> None:
    scan = SSEScan()
    assert [scan.has_data(chunk) for chunk in chunks] == expected


async def test_a_retire_stops_its_calls_concurrently_a_bounded_number_at_a_time(calls: ModelCalls) -> None:
    # Issue 30: not one call after another, and not all of thousands at once: at most retire_concurrency.
    calls.retire_concurrency = 3
    release = asyncio.Event()
    routes = [ScriptedRoute([START_JSON, body(b"{}")], on_cancel=release) for _ in range(7)]
    callers = [Caller(calls, route, f"/ng-rollout/r{i}/v1/responses") for i, route in enumerate(routes)]
    await wait_until(lambda: len(list(calls._calls())) == 7, what="seven calls running")
    retire = asyncio.ensure_future(
        calls.retire(episode_ids=[EpisodeId(rollout_id=f"r{i}", attempt=0) for i in range(7)])
    )
    # Three cancelled at once, each in its (slow) cleanup: concurrent, and no more than the bound.
    await wait_until(lambda: sum(r.cancelled for r in routes) == 3, what="three calls stopping")
    await settle()
    assert sum(r.cancelled for r in routes) == 3 and not retire.done()
    release.set()
    await asyncio.wait_for(retire, 10)
    assert all(r.cancelled and r.cleanup_done for r in routes)
    await asyncio.gather(*(caller.task for caller in callers))
    assert all(caller.received[0]["status"] == 409 for caller in callers)


async def test_the_commit_reply_counts_answered_and_held_calls_per_episode_until_forgotten(calls: ModelCalls) -> None:
    # Two answered calls of r1 (one of them held by the checkpoint), one of r2-a1, a refused one of r3.
    for path in ("/ng-rollout/r1/v1/responses", "/ng-rollout/r2-a1/v1/responses"):
        route = ScriptedRoute([START_JSON, body(b"{}")])
        caller = Caller(calls, route, path)
        route.all()
        await caller.task
    refused = ScriptedRoute([{**START_JSON, "status": 500}, body(b"{}")])
    caller = Caller(calls, refused, "/ng-rollout/r3/v1/responses")
    refused.all()
    await caller.task
    route = ScriptedRoute([START_JSON, body(b"{}")])
    held = Caller(calls, route)
    await settle()
    calls.close_admission("ck")
    route.all()
    await wait_until(lambda: calls.held == 1, what="the response held")
    running = Caller(calls, ScriptedRoute([START_JSON, body(b"{}")]), "/ng-rollout/r4/v1/responses")
    await settle()
    extras = calls.export(checkpoint_id="ck", scope=frozenset()).reply_extras
    assert extras == {
        "answered_calls": {"r1": 2, "r2-a1": 1},
        "held_calls": {"r1": 1},
        "running_calls": {"r4": 1},
        "answered_output_tokens": {},  # no answer reported usage
        "held_output_tokens": {},
    }
    calls.open_admission("ck")
    await held.task
    # Forgotten (its /run returned) or retired: nothing kept about the rollout any more.
    calls.forgotten(rollout_ids=["r1"])
    await calls.retire(episode_ids=[EpisodeId(rollout_id="r2", attempt=1), EpisodeId(rollout_id="r4", attempt=0)])
    await running.task
    assert calls.export(checkpoint_id="ck2", scope=None).reply_extras == {
        "answered_calls": {},
        "held_calls": {},
        "running_calls": {},
        "answered_output_tokens": {},
        "held_output_tokens": {},
    }


async def test_the_commit_reply_counts_the_output_tokens_answers_report_per_episode(calls: ModelCalls) -> None:
    responses = orjson.dumps({"output": [], "max_output_tokens": 999, "usage": {"input_tokens": 5, "output_tokens": 7}})
    chat = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 11, "total_tokens": 14}})
    for path, data in (("/ng-rollout/r1/v1/responses", responses), ("/ng-rollout/r1/v1/chat/completions", chat)):
        route = ScriptedRoute([START_JSON, body(data)])
        caller = Caller(calls, route, path)
        route.all()
        await caller.task
    # An event stream: in-progress events carry no count, the last event's usage is the call's, its key and
    # count split across two chunks; a refused call and a call without usage count nothing.
    stream = [
        START_SSE,
        body(b'data: {"type": "response.created", "response": {"usage": null}}\n\n', more=True),
        body(b'data: {"type": "response.output_text.delta", "delta": "\\"output_tokens\\": 99"}\n\n', more=True),
        body(b'data: {"type": "response.completed", "response": {"usage": {"output_to', more=True),
        body(b'kens": 2', more=True),
        body(b'3, "output_tokens_details": {"reasoning_tokens": 4}}}}\n\n'),
    ]
    route = ScriptedRoute(stream)
    caller = Caller(calls, route, "/ng-rollout/r2-a1/v1/responses")
    route.all()
    await caller.task
    assert caller.received == stream  # counted on the way through, unchanged
    for path, start in (
        ("/ng-rollout/r3/v1/responses", {**START_JSON, "status": 500}),
        ("/ng-rollout/r3/v1/chat/completions", START_JSON),
    ):
        route = ScriptedRoute([start, body(b'{"usage": null, "error": "no \\"output_tokens\\": 5"}')])
        caller = Caller(calls, route, path)
        route.all()
        await caller.task
    # A held answer is counted before it goes out: answered and held.
    route = ScriptedRoute([START_JSON, body(orjson.dumps({"usage": {"output_tokens": 5}}))])
    held = Caller(calls, route, "/ng-rollout/r4/v1/responses")
    await settle()
    calls.close_admission("ck")
    route.all()
    await wait_until(lambda: calls.held == 1, what="the response held")
    extras = calls.export(checkpoint_id="ck", scope=frozenset()).reply_extras
    assert extras["answered_calls"] == {"r1": 2, "r2-a1": 1, "r3": 1, "r4": 1}
    assert extras["answered_output_tokens"] == {"r1": 7 + 11, "r2-a1": 23, "r4": 5}
    assert extras["held_output_tokens"] == {"r4": 5}
    calls.open_admission("ck")
    await held.task
    calls.forgotten(rollout_ids=["r1"])
    await calls.retire(episode_ids=[EpisodeId(rollout_id="r2", attempt=1)])
    assert calls.export(checkpoint_id="ck2", scope=None).reply_extras["answered_output_tokens"] == {"r4": 5}
