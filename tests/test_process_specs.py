"""How each deployment process starts: argv per entrypoint form, cwd, environment, readiness probe."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from nemo_gym_checkpoint_plugin.testing.gym_config import (
    AGENT,
    BACKEND,
    ENVIRONMENT,
    GYM_SERVERS,
    MODEL,
    RESOURCES,
    build_gym_config,
    server_location,
)
from nemo_gym_checkpoint_plugin.testing.process_specs import (
    FAKE_BACKEND_MODULE,
    backend_spec,
    fake_backend_script,
    gym_specs,
)

BASE = 31000


def _specs(tmp_path: Path, entrypoints: dict[str, str] | None = None, server_dirs: dict[str, Path] | None = None):
    config = build_gym_config(BASE, tmp_path, entrypoints=entrypoints)
    config_yaml = OmegaConf.to_yaml(config)
    specs = gym_specs(config, config_yaml, server_dirs=server_dirs, python="/opt/py/bin/python")
    return config, config_yaml, {spec.name: spec for spec in specs}


def test_entrypoint_forms_become_a_path_or_a_module(tmp_path: Path) -> None:
    _, _, specs = _specs(
        tmp_path, entrypoints={MODEL: "app.py", AGENT: "-mpkg.agent_main", RESOURCES: "pkg.resources_main"}
    )
    assert specs[MODEL].argv == ("/opt/py/bin/python", "app.py")
    assert specs[AGENT].argv == ("/opt/py/bin/python", "-m", "pkg.agent_main")
    assert specs[RESOURCES].argv == ("/opt/py/bin/python", "-m", "pkg.resources_main")


def test_each_server_gets_gyms_environment_its_dir_and_its_url(tmp_path: Path) -> None:
    config, config_yaml, specs = _specs(tmp_path)
    assert list(specs) == list(GYM_SERVERS)
    for name, spec in specs.items():
        inner = server_location(config, name)[2]
        assert spec.env["NEMO_GYM_CONFIG_DICT"] == config_yaml
        assert spec.env["NEMO_GYM_CONFIG_PATH"] == name
        assert spec.env["PYTHONPATH"].split(os.pathsep)[0] == str(spec.cwd)
        assert spec.cwd.is_dir()
        assert spec.url == f"http://{inner['host']}:{inner['port']}" and spec.url.startswith("http://127.0.0.1:")
        assert spec.ready_path == "/readyz"


def test_server_dirs_override_gyms_lookup(tmp_path: Path) -> None:
    own = tmp_path / "own_env_server"
    own.mkdir()
    _, _, specs = _specs(tmp_path, server_dirs={ENVIRONMENT: own})
    assert specs[ENVIRONMENT].cwd == own
    assert specs[ENVIRONMENT].env["PYTHONPATH"].split(os.pathsep)[0] == str(own)
    # The others still come from Gym's own lookup.
    assert specs[MODEL].cwd != own and specs[MODEL].cwd.is_dir()


def test_backend_runs_the_packaged_module_from_the_work_dir(tmp_path: Path) -> None:
    spec = backend_spec(BASE, tmp_path)
    assert spec.name == BACKEND
    assert spec.argv[0] == sys.executable
    assert spec.argv[1:3] == ("-m", FAKE_BACKEND_MODULE)
    assert spec.argv[spec.argv.index("--port") + 1] == str(BASE)
    assert spec.argv[spec.argv.index("--host") + 1] == "127.0.0.1"
    assert spec.cwd == tmp_path and spec.url == f"http://127.0.0.1:{BASE}" and spec.ready_path == "/v1/models"
    assert fake_backend_script().name == "fake_backend.py" and fake_backend_script().is_file()
