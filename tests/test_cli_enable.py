"""``ng-checkpoint enable``: the checkpointed config it writes and the server venvs it prepares.

``tests/test_ng_run.py`` starts the result with Gym's own launcher; here the config and the
venvs are checked directly (real venvs, real interpreters importing the plugin).
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import orjson
import pytest
import yaml

from nemo_gym_checkpoint_plugin.cli._enable import LAUNCH_ENTRYPOINT, PTH_NAME

NG_CHECKPOINT = [sys.executable, "-m", "nemo_gym_checkpoint_plugin.cli"]
# A user's Gym YAML as Gym documents it: shipped server configs, plain entrypoints, no checkpoint block.
USER_CONFIG = {
    "config_paths": [
        "responses_api_models/vllm_model/configs/vllm_model.yaml",
        "responses_api_agents/simple_agent/configs/simple_agent.yaml",
        "environment_servers/single_agent_turn/configs/single_agent_turn.yaml",
    ],
    "policy_base_url": "http://127.0.0.1:29000/v1",
    "policy_api_key": "k",
    "policy_model_name": "m",
    "simple_agent": {
        "responses_api_agents": {
            "simple_agent": {
                "entrypoint": "app.py",
                "host": "127.0.0.1",
                "port": 29002,
                "resources_server": {"type": "resources_servers", "name": "example_single_tool_call"},
            }
        }
    },
    "example_single_tool_call": {
        "resources_servers": {
            "example_single_tool_call": {
                "entrypoint": "app.py",
                "host": "127.0.0.1",
                "port": 29003,
                "domain": "agent",
                "verified": False,
                "description": "d",
            }
        }
    },
    "single_agent_turn": {
        "environment_servers": {
            "single_agent_turn": {
                "entrypoint": "app.py",
                "host": "127.0.0.1",
                "port": 29004,
                "resources_server": {"type": "resources_servers", "name": "example_single_tool_call"},
                "agent_server": {"type": "responses_api_agents", "name": "simple_agent"},
            }
        }
    },
}
SERVERS = {"policy_model", "simple_agent", "example_single_tool_call", "single_agent_turn"}


def enable(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*NG_CHECKPOINT, "enable", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture
def user_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(USER_CONFIG))
    return path


def test_enable_writes_the_checkpointed_config_and_venvs_that_import_the_plugin(user_yaml, tmp_path):
    done = enable(tmp_path, str(user_yaml), "--json")
    assert done.returncode == 0, done.stderr
    report = orjson.loads(done.stdout)
    out = tmp_path / "my.checkpointed.yaml"
    assert report["written"] == str(out) and report["token_env"] == "NG_CHECKPOINT_TOKEN"
    written = yaml.safe_load(out.read_text())
    # The user's keys kept; every server (the ones from config_paths too) wrapped and addressed.
    assert written["config_paths"] == USER_CONFIG["config_paths"]
    assert written["checkpoint"] == {"enabled": True, "control_auth_token_env": "NG_CHECKPOINT_TOKEN"}
    assert written["skip_venv_if_present"] is True
    servers = {
        name: next(iter(next(iter(block.values())).values())) for name, block in written.items() if name in SERVERS
    }
    assert set(servers) == SERVERS
    assert {s["entrypoint"] for s in servers.values()} == {LAUNCH_ENTRYPOINT}
    assert all(s.get("host") and s.get("port") for s in servers.values())
    assert servers["simple_agent"]["port"] == 29002 and servers["simple_agent"]["resources_server"]
    for server in report["servers"]:
        python = Path(server["venv"]) / "bin" / "python"
        assert Path(server["venv"]) == tmp_path / server["type"] / server["implementation"] / ".venv"
        assert server["action"] == "created, layered on this environment"
        # Gym's launcher runs exactly this: the venv's python, the entrypoint, from the server dir.
        probe = subprocess.run(
            [str(python), "-c", "import nemo_gym_checkpoint_plugin.wrap, nemo_gym, sys;print(sys.prefix)"],
            cwd=server["server_dir"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert probe.returncode == 0, probe.stderr
        assert probe.stdout.strip() == server["venv"]  # its own venv, not this one

    # Again, on the written config: nothing to write, every venv kept.
    again = orjson.loads(enable(tmp_path, str(out), "--json").stdout)
    assert again["written"] is None
    assert {s["action"] for s in again["servers"]} == {"kept (imports the plugin)"}


def test_an_existing_venv_without_the_plugin_gets_the_layer(user_yaml, tmp_path):
    bare = tmp_path / "resources_servers" / "example_single_tool_call" / ".venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(bare)
    python = bare / "bin" / "python"
    # From a directory of its own: python -c puts the cwd first on sys.path (this checkout holds the plugin).
    assert (
        subprocess.run(
            [str(python), "-c", "import nemo_gym_checkpoint_plugin"], capture_output=True, timeout=60, cwd=tmp_path
        ).returncode
        != 0
    )
    done = orjson.loads(enable(tmp_path, str(user_yaml), "-o", str(tmp_path / "out.yaml"), "--json").stdout)
    actions = {s["name"]: s["action"] for s in done["servers"]}
    assert actions["example_single_tool_call"] == "layered on this environment"
    assert list(bare.glob(f"lib/python*/site-packages/{PTH_NAME}"))
    assert (
        subprocess.run(
            [str(python), "-c", "import nemo_gym_checkpoint_plugin.wrap"], capture_output=True, timeout=60, cwd=tmp_path
        ).returncode
        == 0
    )


def test_enable_refuses_what_it_cannot_use(tmp_path):
    missing = enable(tmp_path, str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "nope.yaml does not exist" in missing.stderr
    empty = tmp_path / "empty.yaml"
    empty.write_text("policy_model_name: m\n")
    none = enable(tmp_path, str(empty))
    assert none.returncode == 2 and "defines no server" in none.stderr


def test_the_written_config_names_the_token_variable_asked_for(user_yaml, tmp_path):
    done = orjson.loads(
        enable(tmp_path, str(user_yaml), "--token-env", "MY_TOKEN", "-o", str(tmp_path / "o.yaml"), "--json").stdout
    )
    assert done["token_env"] == "MY_TOKEN"
    assert yaml.safe_load((tmp_path / "o.yaml").read_text())["checkpoint"]["control_auth_token_env"] == "MY_TOKEN"


def test_a_server_without_a_port_gets_a_free_one_and_enable_says_so(user_yaml, tmp_path):
    # policy_model comes from the wheel's vllm_model.yaml, which gives no port (Gym's launcher would pick one).
    done = enable(tmp_path, str(user_yaml), "--json")
    assert done.returncode == 0, done.stderr
    report = orjson.loads(done.stdout)
    written = yaml.safe_load((tmp_path / "my.checkpointed.yaml").read_text())
    port = written["policy_model"]["responses_api_models"]["vllm_model"]["port"]
    assert isinstance(port, int) and 10001 <= port <= 20000, port
    assert report["ports_chosen"] == {"policy_model": port}
    assert any("policy_model" in w and str(port) in w for w in report["warnings"]), report["warnings"]
    # The ports the config gives stay as they are.
    assert written["simple_agent"]["responses_api_agents"]["simple_agent"]["port"] == 29002
    human = enable(tmp_path, str(user_yaml), "-o", str(tmp_path / "again.yaml"))
    assert human.returncode == 0 and "policy_model: no port in the config, pinned to" in human.stderr, human.stderr


@pytest.mark.parametrize(
    ("block", "says"),
    [({"enabeld": True}, "enabeld"), ({"storage": {"backend": "nfs-magic"}}, "nfs-magic")],
)
def test_a_checkpoint_block_the_servers_would_refuse_is_refused_before_anything_is_written(tmp_path, block, says):
    config = {**USER_CONFIG, "checkpoint": block}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    done = enable(tmp_path, str(path))
    assert done.returncode == 2 and says in done.stderr and "nothing was written" in done.stderr, done.stderr
    assert not (tmp_path / "bad.checkpointed.yaml").exists()
    assert not list(tmp_path.glob("*/*/.venv"))  # no server environment prepared either


def test_a_config_holding_the_token_is_written_private_with_a_warning(tmp_path):
    config = {**USER_CONFIG, "checkpoint": {"control_auth_token": "an-inline-token-0123456789"}}
    path = tmp_path / "inline.yaml"
    path.write_text(yaml.safe_dump(config))
    done = enable(tmp_path, str(path), "--json")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "inline.checkpointed.yaml"
    assert (out.stat().st_mode & 0o777) == 0o600
    assert any("control_auth_token_env" in w for w in orjson.loads(done.stdout)["warnings"])
