"""An environment server decodes an explicit ``"<id>-aN"`` on Gym's typed ``/run`` path itself (issue 24).

Gym 0.7.0's own ``rollout_collection._episode_request_body`` sends a row whose ``_ng_rollout_id`` is
``"r7-a2"`` as ``{"rollout_id": "r7-a2", "attempt": 0}``; with checkpointing on the server runs it as
attempt 2 of ``r7`` (its gate attributes it so), and refuses a suffix beside a non-zero attempt with a
typed 422. With checkpointing off the server is Gym's own and refuses the reserved suffix.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import httpx
import orjson
import pytest
from fastapi import FastAPI, Request
from nemo_gym.rollout_collection import _episode_request_body

from nemo_gym_checkpoint_plugin._errors import AmbiguousEpisode
from nemo_gym_checkpoint_plugin._explicit_ids import ExplicitAttemptIds, decode_run_body
from nemo_gym_checkpoint_plugin.coordination import discover, retire
from nemo_gym_checkpoint_plugin.testing.deployment import rollout_body
from nemo_gym_checkpoint_plugin.testing.gym_config import DEFAULT_CHECKPOINT_BLOCK, wrapped_entrypoints
from nemo_gym_checkpoint_plugin.testing.harness import HARNESS_TOKEN

CONTROL_STATUS = "/ng-control/v1/checkpoint/status"


def gym_row(explicit_id: str, **extra: Any) -> dict[str, Any]:
    """A materialized row as Gym's collection holds it, naming its rollout explicitly."""
    task = rollout_body(explicit_id.split("-a")[0])["task"]
    return {"task_id": task["task_id"], "task_input": task["task_input"], "_ng_rollout_id": explicit_id, **extra}


# -- the body rewrite ------------------------------------------------------------------------------


def test_gyms_typed_body_for_an_explicit_id_is_attempt_n_of_the_prefix() -> None:
    body = _episode_request_body(gym_row("r7-a2"))
    assert body["episode_id"] == {"rollout_id": "r7-a2", "attempt": 0}  # what Gym 0.7.0 sends
    decoded = orjson.loads(decode_run_body(orjson.dumps(body)))
    assert decoded["episode_id"] == {"rollout_id": "r7", "attempt": 2}
    assert list(decoded) == list(body) and decoded["task"] == body["task"]


@pytest.mark.parametrize(
    "body",
    [
        {"episode_id": {"rollout_id": "r7", "attempt": 2}, "task": {}},  # no suffix
        {"episode_id": {"rollout_id": "r7-a0", "attempt": 0}, "task": {}},  # -a0 is a plain id
        {"episode_id": {"rollout_id": "r7-a01", "attempt": 0}, "task": {}},  # so is -a01
        {"episode_id": {"rollout_id": "bad id-a1", "attempt": 0}},  # Gym's validation answers
        {"episode_id": {"rollout_id": "r7-a2", "attempt": -1}},
        {"episode_id": {"rollout_id": "r7-a2", "attempt": "0"}},
        {"episode_id": "r7-a2"},
        {"_ng_rollout_id": "r7-a2"},  # a flat row: not this path's
        ["r7-a2"],
    ],
)
def test_other_bodies_are_left_alone(body: Any) -> None:
    assert decode_run_body(orjson.dumps(body)) is None


def test_a_suffix_with_a_non_zero_attempt_is_refused_as_ambiguous() -> None:
    with pytest.raises(AmbiguousEpisode, match="already names attempt 2") as refused:
        decode_run_body(orjson.dumps({"episode_id": {"rollout_id": "r7-a2", "attempt": 1}}))
    assert refused.value.status == 422 and refused.value.code == "ambiguous_episode_id"


def test_a_body_orjson_refuses_is_decoded_as_gym_reads_it() -> None:
    utf16 = json.dumps({"episode_id": {"rollout_id": "r7-a3", "attempt": 0}, "x": float("nan")}).encode("utf-16")
    decoded = json.loads(decode_run_body(utf16))
    assert decoded["episode_id"] == {"rollout_id": "r7", "attempt": 3} and decoded["x"] != decoded["x"]


async def test_the_middleware_hands_the_route_the_decoded_body_and_refuses_ambiguity() -> None:
    app = FastAPI()
    seen: list[tuple[bytes, str | None]] = []

    @app.post("/run")
    async def run(request: Request) -> dict[str, Any]:
        seen.append((await request.body(), request.headers.get("content-length")))
        return {}

    app.add_middleware(ExplicitAttemptIds)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        plain = orjson.dumps({"episode_id": {"rollout_id": "r7", "attempt": 1}})
        assert (await client.post("/run", content=plain)).status_code == 200
        assert seen[-1][0] == plain  # byte for byte
        reply = await client.post("/run", content=orjson.dumps({"episode_id": {"rollout_id": "r7-a12"}}))
        assert reply.status_code == 200
        body, length = seen[-1]
        assert orjson.loads(body) == {"episode_id": {"rollout_id": "r7", "attempt": 12}} and length == str(len(body))
        refused = await client.post("/run", content=orjson.dumps({"episode_id": {"rollout_id": "r7-a2", "attempt": 3}}))
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "ambiguous_episode_id"
    assert len(seen) == 2


# -- real servers --------------------------------------------------------------------------------


async def _post(url: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        async with http.post(url, json=body) as reply:
            return reply.status, await reply.json(content_type=None)


@pytest.mark.slow
async def test_wrapped_environment_runs_gyms_explicit_attempt_and_refuses_what_it_must(gym_deployment_factory) -> None:
    harness = gym_deployment_factory(checkpoint=DEFAULT_CHECKPOINT_BLOCK, entrypoints=wrapped_entrypoints())
    run = harness.env_url + "/run"

    status, reply = await _post(run, _episode_request_body(gym_row("r7-a2")))
    assert status == 200, reply
    assert reply["episode_id"] == {"rollout_id": "r7", "attempt": 2} and reply["result"]["reward"] == 1.0

    status, reply = await _post(
        run, {**_episode_request_body(gym_row("r7-a2")), "episode_id": {"rollout_id": "r7-a2", "attempt": 1}}
    )
    assert status == 422 and reply["error"]["code"] == "ambiguous_episode_id", reply

    # The gate sees the decoded attempt: once attempt 3 of r8 is retired, "r8-a3" is refused stale_attempt.
    coordinator = await discover(harness.deployment.config, HARNESS_TOKEN)
    async with coordinator:
        await retire(coordinator, "retire-r8", [{"rollout_id": "r8", "attempt": 3}], timeout=30)
    status, reply = await _post(run, _episode_request_body(gym_row("r8-a3")))
    assert status == 409 and reply["error"]["code"] == "stale_attempt", reply
    status, reply = await _post(run, _episode_request_body(gym_row("r8-a4")))
    assert status == 200 and reply["episode_id"] == {"rollout_id": "r8", "attempt": 4}, reply


@pytest.mark.slow
async def test_with_checkpointing_off_the_wrapped_environment_is_gyms_own(gym_deployment_factory) -> None:
    harness = gym_deployment_factory(checkpoint={"enabled": False}, entrypoints=wrapped_entrypoints())
    status, reply = await _post(harness.env_url + "/run", _episode_request_body(gym_row("r7-a2")))
    assert status == 422 and "reserved attempt suffix" in json.dumps(reply)


async def test_the_gate_reuses_the_body_the_decoding_buffered_and_attributes_the_decoded_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On an environment's ``/run`` the body is buffered once, by the decoding outside the gate (issue 26's cost).

    The gate, with marks present, must read the bytes the decoding handed on (the decoded ones when it
    rewrote the body), not buffer the request a second time.
    """
    from nemo_gym_checkpoint_plugin import _gate
    from nemo_gym_checkpoint_plugin._admission import Admission, RetiredMarks

    buffered: list[bytes] = []
    real_buffer = _gate.buffer_body

    async def counting_buffer(receive: Any) -> Any:
        body, replay = await real_buffer(receive)
        buffered.append(body)
        return body, replay

    monkeypatch.setattr(_gate, "buffer_body", counting_buffer)
    app = FastAPI()
    seen: list[bytes] = []

    @app.post("/run")
    async def run(request: Request) -> dict[str, Any]:
        seen.append(await request.body())
        return {}

    marks = RetiredMarks()
    marks.mark("r7", 2)
    _gate.install_gate(app, Admission(), marks)
    app.add_middleware(ExplicitAttemptIds)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        live = orjson.dumps({"episode_id": {"rollout_id": "r7", "attempt": 3}, "task": {"x": 1}})
        assert (await client.post("/run", content=live)).status_code == 200
        retired = await client.post("/run", content=orjson.dumps({"episode_id": {"rollout_id": "r7-a2"}}))
        decoded_live = await client.post("/run", content=orjson.dumps({"episode_id": {"rollout_id": "r7-a4"}}))
    assert retired.status_code == 409 and retired.json()["error"]["code"] == "stale_attempt"
    assert decoded_live.status_code == 200
    assert seen == [live, orjson.dumps({"episode_id": {"rollout_id": "r7", "attempt": 4}})]
    assert buffered == []  # the gate never buffered a body of its own


async def test_run_body_attempt_parses_a_body_once_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    from nemo_gym_checkpoint_plugin import _gate

    parsed: list[bytes] = []
    real_parse = _gate.attempt_from_run_body
    monkeypatch.setattr(_gate, "attempt_from_run_body", lambda body: parsed.append(body) or real_parse(body))
    body = orjson.dumps({"episode_id": {"rollout_id": "r1", "attempt": 5}})
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Any:
        return messages.pop(0)

    scope: dict[str, Any] = {"type": "http", "path": "/run", "method": "POST"}
    first, replay = await _gate.run_body_attempt(scope, receive)
    second, same = await _gate.run_body_attempt(scope, replay)
    assert first == second == ("r1", 5) and same is replay
    assert parsed == [body]
    assert (await replay())["body"] == body  # the app still reads the whole body
