"""The plugin's server client against real uvicorn servers on 127.0.0.1.

A small recording server (a uvicorn process) stands in for each Gym server: it appends every
request's raw path to a file, and on ``/run`` with a crash marker present it exits without
answering (a crash mid-request: the client sees the connection drop). The tests drive
``CheckpointServerClient`` and, as the control, Gym's own ``ServerClient``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nemo_gym import server_utils
from nemo_gym.rollout_correlation import rollout_context
from nemo_gym.server_utils import GlobalAIOHTTPAsyncClientConfig, ServerClient, set_global_aiohttp_client
from omegaconf import OmegaConf

from nemo_gym_checkpoint_plugin._client import CheckpointServerClient, never_resent
from nemo_gym_checkpoint_plugin.testing.deployment import port_is_free
from nemo_gym_checkpoint_plugin.testing.harness import free_port_base, wait_until

HOST = "127.0.0.1"

RECORDER = r"""
import os, sys
from pathlib import Path
import uvicorn

log = Path(sys.argv[2])
marker = Path(sys.argv[3])

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    with log.open("a") as f:
        f.write(scope["raw_path"].decode() + "\n")
        f.flush()
        os.fsync(f.fileno())
    if scope["path"].endswith("/run") and marker.exists():
        marker.unlink()
        os._exit(3)  # a crash while the call is in flight: the connection drops unanswered
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{\"ok\": true}"})

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


class Recorder:
    """One recording uvicorn process; ``restart()`` starts a fresh one on the same port after a crash."""

    def __init__(self, work: Path, name: str, port: int) -> None:
        self.script = work / "recorder.py"
        self.script.write_text(RECORDER)
        self.log = work / f"{name}.paths"
        self.marker = work / f"{name}.crash"
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(self.script), str(self.port), str(self.log), str(self.marker)],
            env={**os.environ, "NO_PROXY": HOST},
        )
        wait_until(lambda: not port_is_free(self.port), 30.0, f"recorder on port {self.port}")

    def crash_on_next_run(self) -> None:
        self.marker.touch()

    @property
    def paths(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=10)


@pytest.fixture
def recorders(tmp_path: Path) -> Iterator[dict[str, Recorder]]:
    base = free_port_base(span=4)
    made = {
        "policy_model": Recorder(tmp_path, "model", base),
        "tools": Recorder(tmp_path, "resources", base + 1),
        "agent": Recorder(tmp_path, "agent", base + 2),
    }
    try:
        for recorder in made.values():
            recorder.start()
        yield made
    finally:
        for recorder in made.values():
            recorder.stop()


def _global_config(recorders: dict[str, Recorder], head_port: int) -> dict:
    def server(type_key: str, impl: str, name: str) -> dict:
        return {type_key: {impl: {"host": HOST, "port": recorders[name].port, "entrypoint": "app.py"}}}

    return {
        "policy_model": server("responses_api_models", "vllm_model", "policy_model"),
        "tools": server("resources_servers", "example_single_tool_call", "tools"),
        "agent": server("responses_api_agents", "simple_agent", "agent"),
        "head_server": {"host": HOST, "port": head_port},
    }


@pytest.fixture
async def gym_http() -> AsyncIterator[None]:
    """Gym's process-wide aiohttp session, made on this test's event loop and closed after it."""
    assert not server_utils.is_global_aiohttp_client_setup()
    session = set_global_aiohttp_client(GlobalAIOHTTPAsyncClientConfig())
    try:
        yield
    finally:
        await session.close()
        server_utils._GLOBAL_AIOHTTP_CLIENT = None


async def _sent(reply_coro: Any) -> int:
    """Await a client call and read its reply, so its pooled connection is released; its status."""
    reply = await reply_coro
    await reply.read()
    reply.release()
    return reply.status


def _clients(recorders: dict[str, Recorder]) -> tuple[CheckpointServerClient, ServerClient]:
    config = OmegaConf.create(_global_config(recorders, free_port_base(span=1)))
    head = server_utils.BaseServerConfig(**config.head_server)
    plain = ServerClient(head_server_config=head, global_config_dict=config)
    return CheckpointServerClient.from_client(plain), plain


async def test_run_is_not_resent_after_the_connection_drops(recorders: dict[str, Recorder], gym_http: None) -> None:
    client, _ = _clients(recorders)
    agent = recorders["agent"]
    agent.crash_on_next_run()
    with pytest.raises(aiohttp.ClientError):
        await client.post("agent", "/run", json={"responses_create_params": {"input": "hi"}})
    # The call returned (with the drop): nothing of it can still be sent. The server saw it once.
    assert agent.paths == ["/run"]
    assert agent.proc is not None and agent.proc.wait(timeout=10) == 3


async def test_gym_client_resends_run_after_the_drop_which_is_what_the_plugin_prevents(
    recorders: dict[str, Recorder], gym_http: None
) -> None:
    import asyncio

    _, plain = _clients(recorders)
    agent = recorders["agent"]
    agent.crash_on_next_run()
    call = asyncio.ensure_future(plain.post("agent", "/run", json={"responses_create_params": {"input": "hi"}}))
    try:
        await asyncio.to_thread(wait_until, lambda: agent.proc.poll() is not None, 30.0, "the recorder crashed")
        agent.start()  # the server comes back on the same port, as after a crash-restart
        status = await asyncio.wait_for(_sent(call), 60.0)
    finally:
        call.cancel()
    assert status == 200
    assert agent.paths == ["/run", "/run"]


async def test_model_and_resources_calls_in_a_rollout_carry_its_prefix(
    recorders: dict[str, Recorder], gym_http: None
) -> None:
    client, plain = _clients(recorders)
    with rollout_context("r7-a2"):
        assert await _sent(client.post("policy_model", "/v1/chat/completions", json={"messages": []})) == 200
        assert await _sent(client.post("tools", "/get_weather", json={"city": "sf"})) == 200
        # Already attributed paths (Gym's own prefix) are sent as they are, never prefixed twice.
        assert await _sent(client.post("policy_model", "/ng-rollout/r7-a2/v1/responses", json={})) == 200
        # Gym's own client, observability off, sends the same call unattributed.
        assert await _sent(plain.post("policy_model", "/v1/chat/completions", json={"messages": []})) == 200
    assert recorders["policy_model"].paths == [
        "/ng-rollout/r7-a2/v1/chat/completions",
        "/ng-rollout/r7-a2/v1/responses",
        "/v1/chat/completions",
    ]
    assert recorders["tools"].paths == ["/ng-rollout/r7-a2/get_weather"]


async def test_resources_calls_outside_a_rollout_take_the_body_key(
    recorders: dict[str, Recorder], gym_http: None
) -> None:
    client, _ = _clients(recorders)
    assert await _sent(client.post("tools", "/verify", json={"_ng_rollout_id": "task3", "_ng_attempt_index": 1})) == 200
    assert await _sent(client.post("tools", "/aggregate_metrics", json={})) == 200
    # Agents are not attributed by path here (their episode routes carry the prefix themselves).
    with rollout_context("r1"):
        assert await _sent(client.post("agent", "/v1/agent_sessions", json={})) == 200
    assert recorders["tools"].paths == ["/ng-rollout/task3-a1/verify", "/aggregate_metrics"]
    assert recorders["agent"].paths == ["/v1/agent_sessions"]


def test_tool_access_base_url_is_attributed_inside_a_rollout(recorders: dict[str, Recorder]) -> None:
    client, _ = _clients(recorders)
    base = f"http://{HOST}:{recorders['tools'].port}"
    assert client._resolve_base_url("tools") == base
    with rollout_context("r9"):
        assert client._resolve_base_url("tools") == base + "/ng-rollout/r9"
        assert client._resolve_base_url("policy_model") == f"http://{HOST}:{recorders['policy_model'].port}"


@pytest.mark.parametrize(
    ("kind", "path", "expected"),
    [
        ("environment", "/run", True),
        ("agent", "/run", True),
        ("agent", "/ng-rollout/r1/v1/responses", True),
        ("agent", "/ng-rollout/r1/training-token-capture/v1/responses", True),
        ("agent", "/v1/agent_sessions/close", False),
        ("model", "/v1/responses", False),
        ("resources", "/ng-rollout/r1/verify", False),
        ("resources", "/run?x=1", True),
    ],
)
def test_which_calls_are_never_resent(kind: str, path: str, expected: bool) -> None:
    assert never_resent(kind, path) is expected
