"""The shipped resources contract suite, run against this package's plugin on its real server.

Each ``make_harness()`` builds a new ``TallyResourcesServer`` in process as a participant
(the testing kit's ``participant_servers``): the plugin is the one the entry-point group
loads (this package must be installed), found by its entry-point name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from tally_verifier.app import TallyResourcesServer

from nemo_gym_checkpoint_plugin.api import EpisodeId, episode_to_wire
from nemo_gym_checkpoint_plugin.testing.contracts import MakeHarness
from nemo_gym_checkpoint_plugin.testing.contracts import resources as resources_contract

# As a deployment's YAML declares it: the state is exported by a plugin (this package's).
BLOCK = {"checkpoint_mode": "export_restore"}

ENTRY_POINT_NAME = "tally_verifier"


class TallyHarness:
    """Episodes are tally sessions seeded over ``/seed_session``; each keeps its own Gym session cookie."""

    def __init__(self, built: Any) -> None:
        self.built = built
        self.participant = built.plugin(ENTRY_POINT_NAME)

    async def _seed(self, episode: EpisodeId, task_data: dict[str, Any]) -> None:
        body = {
            "resources_session_id": f"res-{episode.rollout_id}-{episode.attempt}",
            "episode_id": episode_to_wire(episode),
            "task_id": {"taskset": "tally", "task_id": episode.rollout_id},
            "task_data": {"target": 2, **task_data},
        }
        async with self.built.client() as http:
            reply = await http.post("/seed_session", json=body)
        assert reply.status_code == 200, reply.text

    async def start(self, episode: EpisodeId) -> None:
        await self._seed(episode, {})

    async def start_restart(self, episode: EpisodeId) -> None:
        await self._seed(episode, {"checkpointable": False})

    async def finish(self, episode: EpisodeId) -> None:
        body = {
            "resources_session_id": f"res-{episode.rollout_id}-{episode.attempt}",
            "episode_id": episode_to_wire(episode),
        }
        async with self.built.client() as http:
            reply = await http.post("/close_session", json=body)
        assert reply.status_code == 200, reply.text

    def available(self, episode: EpisodeId) -> bool:
        tallies = self.built.server.tallies.values()
        return any((t.rollout_id, t.attempt) == (episode.rollout_id, episode.attempt) for t in tallies)

    def bad_record(self, episode: EpisodeId) -> Mapping[str, Any]:
        return {"episode_id": episode_to_wire(episode), "target": 2, "total": 1}  # no session_id

    async def status(self) -> Mapping[str, Any]:
        return await self.built.status()


class TestTallyContract(resources_contract.TestResourcesContract):
    @pytest.fixture
    def make_harness(self, participant_servers: Any) -> MakeHarness:
        async def make() -> TallyHarness:
            return TallyHarness(participant_servers(TallyResourcesServer, name="tally", block=BLOCK))

        return make
