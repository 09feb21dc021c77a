"""The public controller client (issue 24): Gym's own ``ServerClient`` that never resends a ``/run``.

A real aiohttp server on 127.0.0.1 drops the connection of every ``/run`` it receives, as a crashed
environment looks to its caller. Gym's ``ServerClient`` sends the ``/run`` again (and again); the
public ``ControllerServerClient`` sends it once and raises the connection error, while any other call
keeps Gym's behaviour. ``ControllerCollectionHelper`` is Gym's ``RolloutCollectionHelper`` on that
client. ``row_at_attempt`` / ``row_episode`` name the attempt a row goes out as through Gym's own
``_episode_request_body``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from nemo_gym import server_utils
from nemo_gym.rollout_collection import RolloutCollectionHelper, _episode_request_body
from nemo_gym.server_utils import BaseServerConfig, GlobalAIOHTTPAsyncClientConfig, ServerClient
from omegaconf import OmegaConf

from nemo_gym_checkpoint_plugin import coordination
from nemo_gym_checkpoint_plugin._identity import from_capture_key
from nemo_gym_checkpoint_plugin.coordination import (
    ControllerCollectionHelper,
    ControllerServerClient,
    is_run_call,
    row_at_attempt,
    row_episode,
)


class DroppingServer:
    """Counts each request by path and closes its connection without a reply."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.changed = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.seen[request.path] = self.seen.get(request.path, 0) + 1
        self.changed.set()
        assert request.transport is not None
        request.transport.close()
        return web.Response()

    async def wait_for(self, path: str, count: int, timeout: float = 30.0) -> None:
        async with asyncio.timeout(timeout):
            while self.seen.get(path, 0) < count:
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
async def dropping() -> AsyncIterator[tuple[DroppingServer, dict[str, Any]]]:
    server = DroppingServer()
    app = web.Application()
    app.router.add_post("/{tail:.*}", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    session = server_utils.set_global_aiohttp_client(GlobalAIOHTTPAsyncClientConfig())
    config = {
        "head_server": {"host": "127.0.0.1", "port": port},
        "env": {"environment_servers": {"single_agent_turn": {"host": "127.0.0.1", "port": port}}},
        "tools": {"resources_servers": {"example_single_tool_call": {"host": "127.0.0.1", "port": port}}},
    }
    try:
        yield server, config
    finally:
        await session.close()
        server_utils._GLOBAL_AIOHTTP_CLIENT = None
        await runner.cleanup()


def _gym_client(config: dict[str, Any]) -> ServerClient:
    return ServerClient(
        head_server_config=BaseServerConfig(**config["head_server"]), global_config_dict=OmegaConf.create(config)
    )


async def test_gyms_own_client_resends_a_run_after_a_dropped_connection(dropping) -> None:
    # The behaviour the public client exists for: without it, a /run that hit a crash is sent again.
    server, config = dropping
    sending = asyncio.ensure_future(_gym_client(config).post(server_name="env", url_path="/run", json={"x": 1}))
    try:
        await server.wait_for("/run", 2)
    finally:
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)


async def test_the_controller_client_sends_a_run_once_and_raises(dropping) -> None:
    server, config = dropping
    client = ControllerServerClient.from_client(_gym_client(config))
    # Bounded: Gym's own loop would resend forever (every 0.5 s) instead of raising.
    with pytest.raises(aiohttp.ServerDisconnectedError):
        async with asyncio.timeout(30):
            await client.post(server_name="env", url_path="/run", json={"x": 1})
    assert server.seen == {"/run": 1}
    # Prefixed or with a query, a /run is still made once.
    with pytest.raises(aiohttp.ServerDisconnectedError):
        async with asyncio.timeout(30):
            await client.post(server_name="env", url_path="/ng-rollout/r1/run?x=1", json={"x": 1})
    assert server.seen["/ng-rollout/r1/run"] == 1


async def test_other_calls_keep_gyms_retries(dropping) -> None:
    server, config = dropping
    client = ControllerServerClient.from_client(_gym_client(config))
    sending = asyncio.ensure_future(client.post(server_name="tools", url_path="/verify", json={"x": 1}))
    try:
        await server.wait_for("/verify", 2)
    finally:
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)


def test_the_collection_helper_is_gyms_on_the_controller_client(monkeypatch: pytest.MonkeyPatch) -> None:
    gym = ServerClient(
        head_server_config=BaseServerConfig(host="127.0.0.1", port=1), global_config_dict=OmegaConf.create({})
    )
    monkeypatch.setattr(RolloutCollectionHelper, "setup_server_client", lambda self, head=None: gym)
    client = ControllerCollectionHelper().setup_server_client()
    assert isinstance(client, ControllerServerClient)
    assert issubclass(ControllerCollectionHelper, RolloutCollectionHelper)
    assert client.head_server_config == gym.head_server_config and client.global_config_dict is gym.global_config_dict
    assert ControllerServerClient.from_client(client) is client


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("POST", "/run", True),
        ("post", "/ng-rollout/r-a1/run", True),
        ("POST", "/run?x=1", True),
        ("POST", "/run/", True),
        ("GET", "/run", False),
        ("POST", "/verify", False),
        ("POST", "/rerun", False),
    ],
)
def test_which_calls_are_runs(method: str, path: str, expected: bool) -> None:
    assert is_run_call(method, path) is expected


TASK = {"task_id": {"taskset": "t", "task_id": "7"}, "task_input": {"responses_create_params": {"input": "hi"}}}


@pytest.mark.parametrize(
    ("row", "attempt", "wire"),
    [
        ({**TASK, "_ng_rollout_id": "r7"}, 2, {"rollout_id": "r7-a2", "attempt": 0}),  # NeMo RL's form
        ({**TASK, "_ng_rollout_id": "r7-a1"}, 2, {"rollout_id": "r7-a2", "attempt": 0}),
        ({**TASK, "_ng_rollout_id": "r7-a1"}, 0, {"rollout_id": "r7", "attempt": 0}),
        ({**TASK, "_ng_rollout_id": "r7", "_ng_attempt_index": 1}, 3, {"rollout_id": "r7-a3", "attempt": 0}),
        ({**TASK, "_ng_task_index": 3, "_ng_rollout_index": 0}, 1, {"rollout_id": "3-0", "attempt": 1}),
        (
            {**TASK, "_ng_task_index": 3, "_ng_rollout_index": 0, "_ng_attempt_index": 2},
            0,
            {"rollout_id": "3-0", "attempt": 0},
        ),
    ],
)
def test_a_row_at_an_attempt_goes_out_through_gyms_own_request_body(row: dict, attempt: int, wire: dict) -> None:
    before = dict(row)
    moved = row_at_attempt(row, attempt)
    assert _episode_request_body(moved)["episode_id"] == wire
    assert row_episode(moved) == {"rollout_id": from_capture_key(wire["rollout_id"]).rollout_id, "attempt": attempt}
    assert row == before  # the input row is left as it was


def test_a_row_naming_its_attempt_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="names its attempt twice"):
        row_episode({**TASK, "_ng_rollout_id": "r7-a1", "_ng_attempt_index": 2})
    with pytest.raises(ValueError, match="attempt must be an int"):
        row_at_attempt(TASK | {"_ng_rollout_id": "r7"}, -1)


def test_the_client_names_are_exported_lazily() -> None:
    assert {"ControllerServerClient", "ControllerCollectionHelper", "row_at_attempt", "row_episode"} <= set(
        coordination.__all__
    )
    with pytest.raises(AttributeError):
        coordination.no_such_name  # noqa: B018
