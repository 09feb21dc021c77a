"""``examples/gym_config.yaml``: Gym's own parser reads it, its ``checkpoint:`` block validates, and it is
the deployment ``make serve`` runs (the testing kit's config at the default ``PORT_BASE``, every server wrapped)."""

from __future__ import annotations

from pathlib import Path

from nemo_gym.global_config import GlobalConfigDictParser, GlobalConfigDictParserConfig
from omegaconf import OmegaConf

from nemo_gym_checkpoint_plugin._settings import load_settings, settings_from_global_config
from nemo_gym_checkpoint_plugin.testing.gym_config import (
    GYM_SERVERS,
    TOKEN_ENV,
    build_gym_config,
    server_location,
    wrapped_entrypoints,
)
from nemo_gym_checkpoint_plugin.testing.serve import DEFAULT_PORT_BASE

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gym_config.yaml"


def _parse_example() -> dict:
    config = GlobalConfigDictParser().parse(
        GlobalConfigDictParserConfig(
            initial_global_config_dict=OmegaConf.create({"config_paths": [str(EXAMPLE)]}),
            skip_load_from_cli=True,
            skip_load_from_dotenv=True,
            offline=True,
        )
    )
    return OmegaConf.to_container(config, resolve=True)


def test_gyms_parser_reads_the_example_and_its_checkpoint_block_validates() -> None:
    config = _parse_example()
    settings = settings_from_global_config(config)
    assert settings.enabled is True
    assert settings.control_auth_token_env == TOKEN_ENV
    assert settings.control_auth_token is None  # the token is never written in the YAML
    validated, token = load_settings(config, environ={TOKEN_ENV: "example-config-token"})
    assert validated == settings and token == "example-config-token"


def test_the_example_is_the_deployment_make_serve_runs(tmp_path: Path) -> None:
    example = _parse_example()
    served = OmegaConf.to_container(
        build_gym_config(DEFAULT_PORT_BASE, tmp_path, entrypoints=wrapped_entrypoints()), resolve=True
    )
    for name in GYM_SERVERS:
        assert server_location(example, name) == server_location(served, name), name
    for key in ("policy_base_url", "policy_api_key", "policy_model_name", "head_server"):
        assert example[key] == served[key], key
    # The example spells out the block's defaults; validated, it is the block `make serve` runs with.
    assert settings_from_global_config(example) == settings_from_global_config(served)
