"""``step_mode: replay`` and the verify step: replayed only when the verifier declared it replayable.

The wheel's ``single_agent_turn`` runs in process with its checkpointable run logic (as in
``tests/test_contract_environment.py``); its resources and agent peers are faked: the seed
reply carries ``x-ng-checkpoint-verify: replay`` only for the rollouts of a declared
verifier, the agent answers at once, and every ``/verify`` is held until the test releases
it, so each episode sits in its verify step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from control_support import wait_until
from gym_fakes import FakeReply
from gym_inprocess import GymServers, InProcessServer
from nemo_gym.rollout_correlation import current_rollout_id
from nemo_gym_checkpoint_plugin.builtin_participants.environment.episode_book import EpisodeBook
from pydantic import ConfigDict
from test_contract_environment import _RESPONSE, FakeGymPeers

from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._types import RestoredRecord, plain_records
from nemo_gym_checkpoint_plugin._wire import VERIFY_HEADER
from nemo_gym_checkpoint_plugin.testing.gym_config import ENVIRONMENT, rollout_body

DECLARED = EpisodeId(rollout_id="declared", attempt=0)
UNDECLARED = EpisodeId(rollout_id="undeclared", attempt=0)


class VerifyHoldingPeers(FakeGymPeers):
    """The agent answers at once; ``/verify`` is held per episode; seeds declare replay for some rollouts."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    replayable_rollouts: set[str]
    in_verify: set[str]
    verifies: dict[str, asyncio.Event]

    async def post(self, server_name: str, url_path: str, **kwargs: Any) -> FakeReply:
        key = current_rollout_id() or "unattributed"
        if url_path.endswith("/v1/responses"):
            return FakeReply(_RESPONSE)
        if url_path == "/verify":
            self.in_verify.add(key)
            try:
                await self.verifies.setdefault(key, asyncio.Event()).wait()
            finally:
                self.in_verify.discard(key)
        reply = await super().post(server_name, url_path, **kwargs)
        if url_path == "/seed_session" and EpisodeId.model_validate(kwargs["json"]["episode_id"]).rollout_id in (
            self.replayable_rollouts
        ):
            reply.headers[VERIFY_HEADER] = "replay"
        return reply


@pytest.fixture
async def environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    servers = GymServers(tmp_path, monkeypatch, ENVIRONMENT)
    runs: list[asyncio.Task[Any]] = []

    def build(step_mode: str) -> tuple[InProcessServer, VerifyHoldingPeers]:
        servers.config["checkpoint"]["step_mode"] = step_mode
        built = servers.build(EpisodeBook)
        original = built.server.server_client
        peers = VerifyHoldingPeers(
            head_server_config=original.head_server_config,
            global_config_dict=original.global_config_dict,
            restart_rollouts=set(),
            in_agent_turn=set(),
            turns={},
            replayable_rollouts={DECLARED.rollout_id},
            in_verify=set(),
            verifies={},
        )
        built.server.server_client = peers
        return built, peers

    async def run_to_verify(built: InProcessServer, peers: VerifyHoldingPeers, episode: EpisodeId) -> None:
        body = rollout_body(episode.rollout_id, attempt=episode.attempt)
        runs.append(asyncio.ensure_future(built.post("/run", body)))
        await wait_until(lambda: episode.capture_key in peers.in_verify, timeout=10.0, what="the verify step")

    yield build, run_to_verify, runs
    for run in runs:
        run.cancel()
    await asyncio.gather(*runs, return_exceptions=True)
    await servers.aclose()


async def test_replay_mode_blocks_only_on_a_verify_not_declared_replayable(environment: Any) -> None:
    build, run_to_verify, runs = environment
    built, peers = build("replay")
    book: EpisodeBook = built.participant
    await run_to_verify(built, peers, DECLARED)
    await run_to_verify(built, peers, UNDECLARED)

    # Idle (a status) and with admission closed (a prepare): only the undeclared verify blocks.
    assert list(book.ready(None).blockers) == [UNDECLARED.capture_key]
    book.close_admission("c1")
    assert list(book.ready("c1").blockers) == [UNDECLARED.capture_key]
    # The declared one is exported at its last boundary (replied), the declaration kept in its state.
    records = {r["episode_id"]["rollout_id"]: r for r in plain_records(book.export("c1", None).records)}
    assert records["declared"]["boundary"] == "replied" and records["declared"]["state"]["verify_replay"] is True

    # The undeclared verify runs to its end (as in wait mode); then nothing blocks.
    peers.verifies.setdefault(UNDECLARED.capture_key, asyncio.Event()).set()
    await wait_until(lambda: not book.ready("c1").blockers, timeout=10.0, what="the undeclared verify to finish")
    book.open_admission("c1")
    peers.verifies.setdefault(DECLARED.capture_key, asyncio.Event()).set()
    replies = await asyncio.wait_for(asyncio.gather(*runs), timeout=10.0)
    assert [reply.status_code for reply in replies] == [200, 200]
    assert [reply.json()["result"]["reward"] for reply in replies] == [1.0, 1.0]


async def test_wait_mode_blocks_on_every_verify(environment: Any) -> None:
    build, run_to_verify, _runs = environment
    built, peers = build("wait")
    await run_to_verify(built, peers, DECLARED)
    await run_to_verify(built, peers, UNDECLARED)
    assert sorted(built.participant.ready(None).blockers) == sorted([DECLARED.capture_key, UNDECLARED.capture_key])


async def test_a_restored_episode_keeps_its_verifier_declaration(environment: Any) -> None:
    build, run_to_verify, _runs = environment
    built, peers = build("replay")
    await run_to_verify(built, peers, DECLARED)
    await run_to_verify(built, peers, UNDECLARED)
    book: EpisodeBook = built.participant
    exported = plain_records(book.export("c1", None).records)
    assert {r["boundary"] for r in exported} == {"replied"}

    # A fresh server (a restarted process) continues both from their boundary: no seed runs again,
    # so the declaration comes from the restored state alone.
    restored, restored_peers = build("replay")
    restored_peers.replayable_rollouts.clear()
    records = []
    for record in exported:
        checkpointed = EpisodeId.model_validate(record["episode_id"])
        replacement = EpisodeId(rollout_id=checkpointed.rollout_id, attempt=checkpointed.attempt + 1)
        records.append(RestoredRecord(checkpointed=checkpointed, replacement=replacement, record=record))
    restored.participant.install("c1", {}, records)
    declared, undeclared = (EpisodeId(rollout_id=e.rollout_id, attempt=1) for e in (DECLARED, UNDECLARED))
    await run_to_verify(restored, restored_peers, declared)
    await run_to_verify(restored, restored_peers, undeclared)
    assert list(restored.participant.ready(None).blockers) == [undeclared.capture_key]
