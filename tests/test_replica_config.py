"""The Gym config of a deployment with replica chains: names, ports, references, as Gym itself reads them."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_gym_checkpoint_plugin.testing.deployment import Deployment
from nemo_gym_checkpoint_plugin.testing.gym_config import (
    AGENT,
    BACKEND,
    ENVIRONMENT,
    GYM_SERVERS,
    MODEL,
    PORT_OFFSETS,
    PORT_SPAN,
    RESOURCES,
    build_gym_config,
    gym_servers,
    port_span,
    replica_name,
    server_location,
)

BASE = 30000


def _ref(config: object, name: str, field: str) -> str:
    return str(server_location(config, name)[2][field]["name"])


def test_one_replica_is_todays_deployment(tmp_path: Path) -> None:
    deployment = Deployment(BASE, tmp_path)
    assert [spec.name for spec in deployment.specs] == [BACKEND, *GYM_SERVERS]
    assert deployment.urls == {name: f"http://127.0.0.1:{BASE + offset}" for name, offset in PORT_OFFSETS.items()}
    assert port_span(1) == PORT_SPAN and gym_servers(1) == GYM_SERVERS
    assert not [key for key in deployment.config if str(key).endswith("_2")]


def test_each_replica_chain_has_its_own_names_ports_and_references(tmp_path: Path) -> None:
    entrypoints = {MODEL: "-mmodel_entry", AGENT: "-magent_entry", ENVIRONMENT: "-menv_entry"}
    deployment = Deployment(BASE, tmp_path, entrypoints=entrypoints, replicas=3)
    config = deployment.config
    names = gym_servers(3)
    assert [spec.name for spec in deployment.specs] == [BACKEND, *names]
    ports = [int(url.rsplit(":", 1)[1]) for url in deployment.urls.values()]
    # Every port distinct, inside the span (the head server keeps +5).
    assert len(set(ports)) == len(ports) and max(ports) == BASE + port_span(3) - 1
    assert BASE + 5 not in ports and config["head_server"]["port"] == BASE + 5
    for i in (1, 2, 3):
        env, agent, model = (replica_name(n, i) for n in (ENVIRONMENT, AGENT, MODEL))
        assert _ref(config, env, "agent_server") == agent
        assert _ref(config, agent, "model_server") == model
        # One resources server and one backend for every chain.
        assert _ref(config, env, "resources_server") == RESOURCES
        assert _ref(config, agent, "resources_server") == RESOURCES
        assert server_location(config, model)[2]["base_url"] == f"http://127.0.0.1:{BASE}/v1"
        # The entrypoint chosen for a server runs every replica of it, in the config and on the command line.
        specs = {spec.name: spec for spec in deployment.specs}
        for base, name in ((ENVIRONMENT, env), (AGENT, agent), (MODEL, model)):
            assert server_location(config, name)[2]["entrypoint"] == entrypoints[base]
            assert specs[name].argv[1:] == ("-m", entrypoints[base].removeprefix("-m"))
            assert specs[name].env["NEMO_GYM_CONFIG_PATH"] == name
    assert deployment.replica_urls(ENVIRONMENT) == [deployment.urls[replica_name(ENVIRONMENT, i)] for i in (1, 2, 3)]
    assert deployment.replica_urls(RESOURCES) == [deployment.urls[RESOURCES]]


def test_the_written_yaml_is_a_config_gym_resolves_every_reference_of(tmp_path: Path) -> None:
    from nemo_gym.config_types import ServerRefNotFoundError
    from nemo_gym.global_config import GlobalConfigDictParser

    deployment = Deployment(BASE, tmp_path, replicas=2)
    written = OmegaConf.create(deployment.write_config(tmp_path / "gym.yaml").read_text())
    # One plain block per server, no `_copy` left: what a hand-written multi-server config holds.
    assert "_copy" not in deployment.config_yaml
    parser = GlobalConfigDictParser()
    instances = parser.filter_for_server_instance_configs(written)
    assert sorted(c.name for c in instances) == sorted(gym_servers(2))
    # Gym's own reference check (ServerRefNotFoundError on a dangling name) passes.
    parser.validate_and_populate_defaults(instances, "127.0.0.1", 10001, 20000, probe_ports=False)
    # A reference to a server that is not there is refused by the same check.
    server_location(written, replica_name(AGENT, 2))[2]["model_server"]["name"] = "policy_model_9"
    with pytest.raises(ServerRefNotFoundError, match="policy_model_9"):
        parser.validate_and_populate_defaults(
            parser.filter_for_server_instance_configs(written), "127.0.0.1", 10001, 20000, probe_ports=False
        )


def test_logs_of_each_replica_go_to_their_own_file(tmp_path: Path) -> None:
    deployment = Deployment(BASE, tmp_path, log_dir=tmp_path / "logs", replicas=2)
    paths = {deployment.log_path(name) for name in deployment.urls}
    assert len(paths) == len(deployment.urls)
    assert deployment.log_path(replica_name(ENVIRONMENT, 2)) == tmp_path / "logs" / "single_agent_turn_2.log"


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_a_replica_count_below_one_is_refused(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ValueError, match="replicas"):
        build_gym_config(BASE, tmp_path, replicas=bad)  # type: ignore[arg-type]


def test_the_harness_finds_free_ports_for_every_replica(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nemo_gym_checkpoint_plugin.testing import harness

    spans: list[int] = []

    def base_for(span: int = PORT_SPAN) -> int:
        spans.append(span)
        return BASE

    monkeypatch.setattr(harness, "free_port_base", base_for)
    deployment = harness.new_deployment(tmp_path, replicas=3)
    assert spans == [port_span(3)] and deployment.replicas == 3


def test_environment_keys_reach_every_environment_replica(tmp_path: Path) -> None:
    default = Deployment(BASE, tmp_path, replicas=2)
    raised = Deployment(BASE, tmp_path, replicas=2, environment={"cleanup_timeout_seconds": 180})
    for i in (1, 2):
        name = replica_name(ENVIRONMENT, i)
        assert server_location(default.config, name)[2]["cleanup_timeout_seconds"] == 30
        assert server_location(raised.config, name)[2]["cleanup_timeout_seconds"] == 180
