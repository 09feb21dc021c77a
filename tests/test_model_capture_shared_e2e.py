"""What the trainer reads is exact on real processes: two model servers on one capture directory, across a crash.

A real Gym deployment with two replica chains (``single_agent_turn -> simple_agent ->
policy_model`` and the same with ``_2``; every server wrapped, ``step_mode: wait``), both model
servers writing 0.7.0's run-wide capture directory (``token_id_capture`` on for all agents): the
local store (``return_token_id_information: true``, Gym's ``trajectories_for_rollout`` reads it),
or external staging (the fake backend stages tokens as a vLLM worker, the model servers write
ledger rows). At the checkpoint:

- two rollouts per chain are inside their agent turn, each with its second model call's
  response **held at its model server** (generating at the backend when admission closed);
- a third "agent" (this test, on Gym's capture path of model server 1) has its second call's
  long answer **streaming**: the answer started reaching it, but it stopped reading, so the
  complete answer never reached it (its boundary is before that call).

Commit, SIGKILL every process group, start fresh processes, restore, resume: every rollout goes
on as attempt 1 (the environment's ``/run``; the stream's agent sends its call again) and
finishes. For every one, the capture of attempt 1 holds each call its turn made exactly once:
Gym's rebuild is unmasked with ``n_calls`` the turn's calls, or the ledger's staged chain
verifies with one record per call and no failure.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nemo_gym.token_id_capture import FileLineageStore, TokenCaptureStore, trajectories_for_rollout
from nemo_gym.token_id_capture.staging.records import RolloutManifest
from test_model_capture_staging import _verified_chain

from nemo_gym_checkpoint_plugin.coordination import commit, discover, prepare, restore, resume
from nemo_gym_checkpoint_plugin.testing.deployment import (
    BACKEND,
    DEFAULT_CHECKPOINT_BLOCK,
    ENVIRONMENT,
    MODEL,
    TOKEN_ENV,
    Deployment,
    free_port_base,
    port_span,
    replica_name,
    rollout_body,
)
from nemo_gym_checkpoint_plugin.testing.fake_backend import STAGING_DIR_ENV
from nemo_gym_checkpoint_plugin.testing.fake_staging import StagingDir
from nemo_gym_checkpoint_plugin.testing.gym_config import wrapped_entrypoints
from nemo_gym_checkpoint_plugin.testing.harness import wait_until_async

pytestmark = pytest.mark.slow

TOKEN = "capture-shared-e2e-token"
LEDGER_TOKEN_ENV = "NEMO_GYM_TOKEN_CAPTURE_CONTROL_TOKEN"
BOUND = 120.0
ROUNDS = 2  # each rollout's turn: a tool call, another, then the answer: three model calls
ROLLOUTS = {1: ["one-0", "one-1"], 2: ["two-0", "two-1"]}
ALL = [r for ids in ROLLOUTS.values() for r in ids]
STREAM = "stream-0"  # the agent whose answer streams at the checkpoint (two model calls)
ANSWER_WORDS = 150_000  # its answer: ~1.5 MB of text, far beyond what the sockets buffer


def _prompt(rollout_id: str) -> str:
    return f"weather please ({rollout_id}) [tool_rounds={ROUNDS}]"


def _stream_request(output: list[dict[str, Any]] | None) -> dict[str, Any]:
    weather = {
        "type": "function",
        "name": "get_weather",
        "description": "",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": ""}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    body: dict[str, Any] = {
        "input": [{"role": "user", "content": f"weather please ({STREAM}) [answer_words={ANSWER_WORDS}]"}],
        "tools": [weather],
    }
    if output is not None:
        call = next(item for item in output if item["type"] == "function_call")
        body["input"] += [
            *output,
            {"type": "function_call_output", "call_id": call["call_id"], "output": '{"weather": "cold"}'},
        ]
        body["stream"] = True
    return body


def _deployment(tmp_path: Path, mode: str) -> Deployment:
    capture: dict[str, Any] = {"enabled": True, "all_agents": True, "dir": str(tmp_path / "captures")}
    env = {TOKEN_ENV: TOKEN}
    if mode == "external":
        capture.update(external_staging=True, rebuild_response=False)
        env.update({LEDGER_TOKEN_ENV: "ledger-token", STAGING_DIR_ENV: str(tmp_path / "staged")})
    return Deployment(
        free_port_base(port_span(2)),
        tmp_path,
        entrypoints=wrapped_entrypoints(),
        own_process_groups=True,
        log_dir=tmp_path / "logs",
        extra_env=env,
        replicas=2,
        checkpoint={**DEFAULT_CHECKPOINT_BLOCK, "step_mode": "wait"},
        model={"return_token_id_information": mode == "local"},
        gym_settings={"token_id_capture": capture},
    )


@pytest.mark.parametrize("mode", ["local", "external"])
def test_two_model_servers_one_capture_directory_held_calls_and_a_stream_every_call_once(
    tmp_path: Path, mode: str
) -> None:
    deployment = _deployment(tmp_path, mode)
    deployment.start()
    try:
        asyncio.run(_scenario(deployment, tmp_path))
    finally:
        deployment.stop()
    keys = [f"{r}-a1" for r in ALL]
    if mode == "local":
        for key in keys + [f"{STREAM}-a1"]:
            built = trajectories_for_rollout(key, [tmp_path / "captures"])
            assert built is not None and built["mask_sample"] is False, (key, built)
            calls = 2 if key.startswith(STREAM) else ROUNDS + 1
            assert built["metrics"]["n_calls"] == calls and not built["metrics"].get("capture_incomplete"), built
            ids = [e.model_call_id for e in TokenCaptureStore(tmp_path / "captures").read_entries(key)]
            assert len(ids) == len(set(ids)) == calls, (key, ids)
    else:
        staging = StagingDir(tmp_path / "staged")
        for key in keys + [f"{STREAM}-a1"]:
            manifest = RolloutManifest.model_validate(
                asyncio.run(FileLineageStore(tmp_path / "captures").manifest(key))
            )
            calls = 2 if key.startswith(STREAM) else ROUNDS + 1
            assert manifest.failures == [] and len(manifest.records) == calls, (key, manifest)
            assert len(_verified_chain(manifest, staging)) == calls


async def _scenario(deployment: Deployment, tmp_path: Path) -> None:
    urls = deployment.urls
    envs = dict(enumerate(deployment.replica_urls(ENVIRONMENT), start=1))
    model_1 = urls[MODEL]
    limits = aiohttp.ClientTimeout(total=None, connect=BOUND, sock_read=BOUND)
    async with aiohttp.ClientSession(timeout=limits) as http:

        async def call(method: str, url: str, **kwargs: Any) -> Any:
            async with http.request(method, url, **kwargs) as reply:
                assert reply.status == 200, await reply.text()
                return await reply.json()

        async def run(replica: int, rollout_id: str, attempt: int) -> dict[str, Any]:
            body = rollout_body(rollout_id, attempt=attempt, prompt=_prompt(rollout_id))
            return await call("POST", envs[replica] + "/run", json=body)

        async def model_calls(name: str) -> dict[str, int]:
            status = await call(
                "GET", urls[name] + "/ng-control/v1/checkpoint/status", headers={"Authorization": f"Bearer {TOKEN}"}
            )
            return status["model_calls"]

        def capture_path(key: str) -> str:
            return f"{model_1}/ng-rollout/{key}/training-token-capture/v1/responses"

        await call("POST", urls[BACKEND] + "/_fake/hold", json={"match": "(one-", "count": 2, "step": 1})
        await call("POST", urls[BACKEND] + "/_fake/hold", json={"match": "(two-", "count": 2, "step": 1})
        first = [asyncio.ensure_future(run(i, r, 0)) for i, ids in ROLLOUTS.items() for r in ids]
        await wait_until_async(
            lambda: _backend_held(call, urls[BACKEND], len(ALL)), BOUND, "every rollout's second model call held"
        )
        # The stream's agent: its first call answered, its second call's answer streams and it stops reading.
        stream_first = await call("POST", capture_path(STREAM), json=_stream_request(None))
        stream = await http.post(capture_path(STREAM), json=_stream_request(stream_first["output"]))
        assert stream.status == 200 and stream.headers["content-type"].startswith("text/event-stream")
        started = await stream.content.read(4096)
        assert started, "the stream's answer began reaching its caller"
        await wait_until_async(
            lambda: _calls_are(model_calls, MODEL, in_flight=3, held=0),
            BOUND,
            "model 1 streaming the answer (2 generating + 1 stream, nothing held)",
        )

        coordinator = await discover(deployment.config, TOKEN)
        async with coordinator:
            prepared = await prepare(coordinator, "shared", timeout=BOUND)
            assert prepared.ready, prepared.to_json()
            # The generations finish now: their responses are held at both model servers.
            await call("POST", urls[BACKEND] + "/_fake/release", json={"match": None})
            for name in (MODEL, replica_name(MODEL, 2)):
                await wait_until_async(
                    lambda name=name: _held_at_least(model_calls, name, 2), BOUND, f"two responses held at {name}"
                )
            scope = prepared.continued([*ALL, STREAM])
            ckpt = tmp_path / "ckpt"
            committed = await commit(coordinator, "shared", str(ckpt), scope, timeout=BOUND)
            # Each model server exported the episodes it answered, never the other's.
            assert committed.replies[MODEL]["episode_ids"] == sorted([*ROLLOUTS[1], STREAM])
            assert committed.replies[replica_name(MODEL, 2)]["episode_ids"] == sorted(ROLLOUTS[2])

        deployment.kill()
        stream.close()
        await asyncio.gather(*first, return_exceptions=True)
        await asyncio.to_thread(deployment.start)

        coordinator = await discover(deployment.config, TOKEN)
        async with coordinator:
            await restore(coordinator, "shared-restore", str(ckpt), scope, timeout=BOUND)
            await resume(coordinator, "shared-restore", timeout=BOUND)
        replies = await asyncio.gather(*(run(i, r, 1) for i, ids in ROLLOUTS.items() for r in ids))
        # The stream's agent never got its second answer: it sends the call again, as attempt 1, and reads it all.
        async with http.post(capture_path(f"{STREAM}-a1"), json=_stream_request(stream_first["output"])) as again:
            assert again.status == 200
            events = (await again.read()).decode()
        assert '"type":"response.completed"' in events.replace(" ", "") or "response.completed" in events
    for rollout_id, reply in zip(ALL, replies, strict=True):
        assert reply["failure"] is None, (rollout_id, reply["failure"])
        assert reply["episode_id"] == {"rollout_id": rollout_id, "attempt": 1}
        assert reply["result"]["reward"] == 1.0, json.dumps(reply)[:400]


async def _backend_held(call: Any, backend: str, count: int) -> bool:
    return (await call("GET", backend + "/_fake/stats?brief=true"))["held"] >= count


async def _calls_are(model_calls: Any, name: str, **expected: int) -> bool:
    counts = await model_calls(name)
    return all(counts[key] == value for key, value in expected.items())


async def _held_at_least(model_calls: Any, name: str, count: int) -> bool:
    return (await model_calls(name))["held"] >= count
