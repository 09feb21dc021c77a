"""A verifier's ``checkpoint_mode``: its config key, a bad value, and a plugin's own declaration.

The wheel's ``example_single_tool_call`` is built in process (``tests/gym_inprocess.py``)
from a generated Gym config whose resources block gets ``checkpoint_mode:``; each episode
is seeded over ``/seed_session`` and the reply's declaration headers are read.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from gym_inprocess import GymServers, InProcessServer
from nemo_gym.base_resources_server import BaseResourcesServerConfig
from nemo_gym.config_types import ResourcesServerTypeConfig
from nemo_gym_checkpoint_plugin.builtin_participants.resources.session_bindings import ResourcesSessions

from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._markers import hookimpl
from nemo_gym_checkpoint_plugin._settings import SettingsError
from nemo_gym_checkpoint_plugin._types import SeedDeclaration
from nemo_gym_checkpoint_plugin._wire import RESTART_HEADER, VERIFY_HEADER
from nemo_gym_checkpoint_plugin.testing.gym_config import RESOURCES, server_location


@pytest.fixture
async def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[GymServers]:
    built = GymServers(tmp_path, monkeypatch, RESOURCES)
    yield built
    await built.aclose()


def _declare(servers: GymServers, mode: Any) -> None:
    # The resources server's own block, next to its entrypoint (as a user's YAML would put it).
    server_location(servers.config, RESOURCES)[2]["checkpoint_mode"] = mode


async def _seed(built: InProcessServer, rollout: str) -> Mapping[str, str]:
    body = {
        "resources_session_id": f"session-{rollout}",
        "episode_id": {"rollout_id": rollout, "attempt": 0},
        "task_id": {"taskset": "declarations", "task_id": rollout},
        "task_data": {},
    }
    reply = await built.post("/seed_session", body)
    assert reply.status_code == 200, reply.text
    return reply.headers


async def test_stateless_declares_every_verify_replayable(servers: GymServers) -> None:
    _declare(servers, "stateless")
    built = servers.build(ResourcesSessions)
    for rollout in ("r1", "r2"):
        headers = await _seed(built, rollout)
        assert headers.get(VERIFY_HEADER) == "replay"
        assert RESTART_HEADER not in headers
    status = await built.status()
    assert status["checkpoint_mode"] == "stateless" and status["capturable"] is True
    assert built.participant.ready(None).restarts == []


async def test_restart_only_makes_every_seed_a_restart(servers: GymServers) -> None:
    _declare(servers, "restart_only")
    built = servers.build(ResourcesSessions)
    headers = await _seed(built, "r1")
    assert headers.get(RESTART_HEADER) == "1" and VERIFY_HEADER not in headers
    # example_single_tool_call keeps bindings the participant could export: the declaration wins.
    status = await built.status()
    assert status["checkpoint_mode"] == "restart_only" and status["capturable"] is False
    assert built.participant.ready(None).restarts == [EpisodeId(rollout_id="r1", attempt=0).capture_key]


async def test_export_restore_is_capturable_and_leaves_verify_to_the_plugin(servers: GymServers) -> None:
    _declare(servers, "export_restore")
    built = servers.build(ResourcesSessions)
    headers = await _seed(built, "r1")
    assert RESTART_HEADER not in headers and VERIFY_HEADER not in headers
    status = await built.status()
    assert status["checkpoint_mode"] == "export_restore" and status["capturable"] is True


async def test_undeclared_keeps_the_older_rule(servers: GymServers) -> None:
    built = servers.build(ResourcesSessions)
    headers = await _seed(built, "r1")
    assert RESTART_HEADER not in headers and VERIFY_HEADER not in headers
    status = await built.status()
    assert status["checkpoint_mode"] is None and status["capturable"] is True


@pytest.mark.parametrize("value", ["replayable", "STATELESS", 1, True])
def test_a_bad_value_stops_the_server_naming_key_and_server(servers: GymServers, value: Any) -> None:
    _declare(servers, value)
    with pytest.raises(SettingsError, match=rf"server '{RESOURCES}': checkpoint_mode: .* is not one of"):
        servers.build(ResourcesSessions)


class _ReplayDeclarer:
    """A verifier's own plugin declaring ``/verify`` replayable through the seed hook."""

    @hookimpl
    def seed_session(self, episode_id: EpisodeId, session: Mapping[str, Any]) -> SeedDeclaration:
        return SeedDeclaration(verify_replay=True)


async def test_a_plugin_declares_verify_replay_through_the_seed_hook(servers: GymServers) -> None:
    # Undeclared server, capturable: the built-in participant has nothing to declare and does not overrule.
    built = servers.build(ResourcesSessions)
    built.control.pm.register(_ReplayDeclarer())
    headers = await _seed(built, "r1")
    assert headers.get(VERIFY_HEADER) == "replay" and RESTART_HEADER not in headers


async def test_a_plugin_cannot_make_a_restart_replayable(servers: GymServers) -> None:
    _declare(servers, "restart_only")
    built = servers.build(ResourcesSessions)
    built.control.pm.register(_ReplayDeclarer())
    headers = await _seed(built, "r1")
    assert headers.get(RESTART_HEADER) == "1" and VERIFY_HEADER not in headers


def test_gym_passes_the_key_through_its_config_but_the_server_config_drops_it() -> None:
    # Why checkpoint_modes.py reads the global config dict by the server's name: Gym's type config
    # allows extra keys (the YAML is accepted), its server config object ignores them.
    block = {"host": "127.0.0.1", "port": 1, "entrypoint": "app.py", "checkpoint_mode": "stateless"}
    parsed = ResourcesServerTypeConfig.model_validate({"resources_servers": {"x": block}})
    assert parsed.resources_servers["x"].model_extra == {"checkpoint_mode": "stateless"}
    config = BaseResourcesServerConfig.model_validate({**block, "name": "x"})
    assert not hasattr(config, "checkpoint_mode")


async def test_the_key_survives_gyms_config_parser(servers: GymServers) -> None:
    # The whole global config, with the key in the resources block, parsed again as Gym parses a YAML.
    from nemo_gym.global_config import GlobalConfigDictParser, GlobalConfigDictParserConfig
    from omegaconf import OmegaConf

    _declare(servers, "stateless")
    servers.config = GlobalConfigDictParser().parse(
        GlobalConfigDictParserConfig(
            initial_global_config_dict=OmegaConf.create(OmegaConf.to_container(servers.config)),
            skip_load_from_cli=True,
            skip_load_from_dotenv=True,
            offline=True,
        )
    )
    built = servers.build(ResourcesSessions)
    assert (await _seed(built, "r1")).get(VERIFY_HEADER) == "replay"
