"""The agent-kind contract suite, run by the built-in ``SimpleAgentSessions`` on the wheel's ``simple_agent``.

The mid-turn cases run the wrapped ``simple_agent`` (``SimpleAgentTurns``) against
``agent_turn_support.ScriptedPeers``, a scripted model and tool server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from agent_turn_support import ROUNDS, ScriptedPeers
from gym_inprocess import TOKEN, GymServers, InProcessServer
from nemo_gym import server_utils
from nemo_gym_checkpoint_plugin.builtin_participants.agent.open_sessions import SimpleAgentSessions

from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._types import plain_records
from nemo_gym_checkpoint_plugin.testing.contracts import MakeHarness
from nemo_gym_checkpoint_plugin.testing.contracts import agent as agent_contract
from nemo_gym_checkpoint_plugin.testing.deployment import free_port_base
from nemo_gym_checkpoint_plugin.testing.gym_config import AGENT, MODEL, PORT_OFFSETS, TOKEN_ENV, build_gym_config


def _session_id(episode: EpisodeId) -> str:
    return f"agent-{episode.rollout_id}"


def _wire(episode: EpisodeId) -> dict[str, Any]:
    return {"rollout_id": episode.rollout_id, "attempt": episode.attempt}


class SimpleAgentHarness:
    """Episodes are agent sessions seeded over ``/v1/agent_sessions``, with one direct tool access each."""

    tool_base = "http://127.0.0.1:9"

    def __init__(self, built: InProcessServer) -> None:
        self.built = built
        self.participant = built.participant

    async def start(self, episode: EpisodeId) -> None:
        reply = await self.built.post("/v1/agent_sessions", self._seed(episode))
        assert reply.status_code == 200, reply.text

    def _seed(self, episode: EpisodeId) -> dict[str, Any]:
        return {
            "agent_session_id": _session_id(episode),
            "episode_id": _wire(episode),
            "task_id": {"taskset": "contract", "task_id": episode.rollout_id},
            "tool_accesses": [
                {
                    "kind": "direct_http",
                    "name": "weather",
                    "required": True,
                    "base_url": f"{self.tool_base}/ng-rollout/{episode.capture_key}",
                    "cookies": {"resources": f"cookie-{episode.rollout_id}"},
                }
            ],
        }

    async def start_restart(self, episode: EpisodeId) -> None:
        raise NotImplementedError("an agent declares no restarts")

    async def finish(self, episode: EpisodeId) -> None:
        body = {"agent_session_id": _session_id(episode), "episode_id": _wire(episode)}
        reply = await self.built.post("/v1/agent_sessions/close", body)
        assert reply.status_code == 200, reply.text

    def available(self, episode: EpisodeId) -> bool:
        record = self.built.server._session_records.get(_session_id(episode))
        if record is None or record.state is None or record.closing:
            return False
        # Both the record and the seed request it holds name the attempt (the close matches on it).
        return record.episode_id == episode and record.state.request.episode_id == episode

    def bad_record(self, episode: EpisodeId) -> Mapping[str, Any]:
        return {"episode_id": _wire(episode), "request": {}}

    async def status(self) -> Mapping[str, Any]:
        return await self.built.status()


_WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def conversation(episode: EpisodeId) -> str:
    return f"weather please ({episode.rollout_id})"


class MidTurnAgentHarness(SimpleAgentHarness):
    """A Simple Agent whose turns call ``ScriptedPeers``; session cookies outlive the server (as a client's do)."""

    rounds = ROUNDS

    def __init__(self, built: InProcessServer, peers: ScriptedPeers, cookies: dict[str, httpx.Cookies]) -> None:
        super().__init__(built)
        self.peers = peers
        self.cookies = cookies
        self.tool_base = f"http://127.0.0.1:{peers.port}"

    async def start(self, episode: EpisodeId) -> None:
        self.cookies.pop(episode.rollout_id, None)  # a new session: seeded without the old one's cookie
        async with self._client(episode) as http:
            reply = await http.post("/v1/agent_sessions", json=self._seed(episode))
            assert reply.status_code == 200, reply.text
            self.cookies[episode.rollout_id] = http.cookies

    def _client(self, episode: EpisodeId) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=self.built.app)
        cookies = self.cookies.get(episode.rollout_id)
        return httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30.0, cookies=cookies)

    def begin_turn(self, episode: EpisodeId) -> asyncio.Task[Any]:
        async def turn() -> httpx.Response:
            async with self._client(episode) as http:
                body = {"input": [{"role": "user", "content": conversation(episode)}], "tools": [_WEATHER_TOOL]}
                return await http.post(f"/ng-rollout/{episode.capture_key}/v1/responses", json=body)

        return asyncio.ensure_future(turn())

    def hold_model(self, episode: EpisodeId, step: int) -> None:
        self.peers.hold(conversation(episode), step)

    def release_model(self, episode: EpisodeId, step: int) -> None:
        self.peers.release(conversation(episode), step)

    def model_held(self, episode: EpisodeId, step: int) -> bool:
        return (conversation(episode), step) in self.peers.held

    def hold_tools(self) -> None:
        self.peers.tool_gate = asyncio.Event()

    def release_tools(self) -> None:
        assert self.peers.tool_gate is not None
        self.peers.tool_gate.set()

    def tools_in_flight(self) -> int:
        return self.peers.tools_in_flight

    def model_completed(self, episode: EpisodeId) -> dict[int, int]:
        return {step: n for (conv, step), n in self.peers.completed.items() if conv == conversation(episode)}

    def tool_calls(self, episode: EpisodeId) -> int:
        return sum(n for key, n in self.peers.tools.items() if key.split("-a")[0] == episode.rollout_id)

    def turn_result_ok(self, reply: Any) -> bool:
        return isinstance(reply, httpx.Response) and reply.status_code == 200


@pytest.fixture
async def mid_turn_agents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MakeHarness]:
    """Builds Simple Agents (each a fresh process) that share one ``ScriptedPeers`` and the clients' cookies."""
    servers = GymServers(tmp_path, monkeypatch, AGENT)
    # The model server's port of the config the agent runs with: the scripted peers answer there.
    port_base = free_port_base()
    servers.config = build_gym_config(
        port_base, tmp_path, checkpoint={"enabled": True, "control_auth_token_env": TOKEN_ENV}
    )
    peers = ScriptedPeers(port_base + PORT_OFFSETS[MODEL])
    await peers.start()
    cookies: dict[str, httpx.Cookies] = {}
    # Gym's process-wide aiohttp session (the agent's calls go through it), on this test's loop.
    assert not server_utils.is_global_aiohttp_client_setup()
    session = server_utils.set_global_aiohttp_client(server_utils.GlobalAIOHTTPAsyncClientConfig())

    async def make() -> MidTurnAgentHarness:
        return MidTurnAgentHarness(servers.build(SimpleAgentSessions), peers, cookies)

    try:
        yield make
    finally:
        await servers.aclose()
        await peers.aclose()
        await session.close()
        server_utils._GLOBAL_AIOHTTP_CLIENT = None


class TestSimpleAgentSessions(agent_contract.TestAgentContract):
    supports_mid_turn = True

    @pytest.fixture
    def make_harness(self, mid_turn_agents: MakeHarness) -> MakeHarness:
        return mid_turn_agents


async def test_a_continued_turn_answers_as_an_uninterrupted_one_with_every_calls_tokens_once(
    mid_turn_agents: MakeHarness, tmp_path: Path
) -> None:
    # Through the control routes: prepare while a model call is held, commit, a fresh server restores.
    first: Any = await mid_turn_agents()
    plain, cut = EpisodeId(rollout_id="same", attempt=0), EpisodeId(rollout_id="cut", attempt=0)
    await first.start(plain)
    reference = await asyncio.wait_for(first.begin_turn(plain), 30)
    assert reference.status_code == 200, reference.text
    await first.start(cut)
    first.hold_model(cut, 1)
    turn = first.begin_turn(cut)
    async with asyncio.timeout(10):
        while (conversation(cut), 1) not in first.peers.held:
            await asyncio.sleep(0.005)  # wait-ok: poll interval of a bounded wait on a condition
    prepared = await _control(first, "prepare", checkpoint_id="ck-1")
    assert prepared["phase"] == "prepared", prepared
    assert prepared["report"]["counts"]["turns_running"] == 1  # still generating, and ready
    checkpoint_dir = str(tmp_path / "ck")
    committed = await _control(
        first,
        "commit",
        checkpoint_id="ck-1",
        checkpoint_dir=checkpoint_dir,
        episode_ids=[{"rollout_id": "cut", "attempt": 0}],
    )
    assert committed["episode_ids"] == ["cut"]
    turn.cancel()  # the process dies with its held call
    await asyncio.gather(turn, return_exceptions=True)
    async with asyncio.timeout(10):
        while (conversation(cut), 1) in first.peers.held:
            await asyncio.sleep(0.005)  # wait-ok: poll interval of a bounded wait on a condition
    first.release_model(cut, 1)

    second: Any = await mid_turn_agents()
    restored = await _control(
        second,
        "restore",
        checkpoint_id="r-1",
        checkpoint_dir=checkpoint_dir,
        episode_ids=[{"rollout_id": "cut", "attempt": 0}],
    )
    assert restored["restored"] == ["cut-a1"]
    await _control(second, "resume", checkpoint_id="r-1")
    continued = await asyncio.wait_for(second.begin_turn(EpisodeId(rollout_id="cut", attempt=1)), 30)
    assert continued.status_code == 200, continued.text

    assert continued.json()["output"] == reference.json()["output"]
    generated = [item["generation_token_ids"] for item in continued.json()["output"] if "generation_token_ids" in item]
    assert generated == [[1000 + step] for step in range(ROUNDS + 1)]  # every call's tokens, once each
    assert second.model_completed(cut) == dict.fromkeys(range(ROUNDS + 1), 1)
    assert second.tool_calls(cut) == ROUNDS


async def _control(harness: Any, route: str, **body: Any) -> dict[str, Any]:
    import time

    transport = httpx.ASGITransport(app=harness.built.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30.0) as http:
        reply = await http.post(
            f"/ng-control/v1/checkpoint/{route}",
            json={**body, "deadline_ts": time.time() + 20},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
    assert reply.status_code == 200, reply.text
    return reply.json()


async def test_a_restored_session_points_its_tool_access_at_the_replacement_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Simple Agent specifics beyond the kind contract: the tool base URL and cookies carry over.
    from nemo_gym_checkpoint_plugin.testing.contracts.base import _restored, _round_trip

    servers = GymServers(tmp_path, monkeypatch, AGENT)
    first = SimpleAgentHarness(servers.build(SimpleAgentSessions))
    episode = EpisodeId(rollout_id="tools", attempt=1)
    await first.start(episode)
    records = _round_trip(plain_records(first.participant.export(checkpoint_id="ck", scope=None)))
    second = SimpleAgentHarness(servers.build(SimpleAgentSessions))
    await second.participant.install(checkpoint_id="r", manifest={}, records=_restored(records))
    state = second.built.server._session_records[_session_id(episode)].state
    assert [str(a.base_url) for a in state.request.tool_accesses] == ["http://127.0.0.1:9/ng-rollout/tools-a2"]
    assert state.resources_cookies == {"resources": "cookie-tools"}
    await servers.aclose()
