"""Gym's own launcher: ``ng-checkpoint enable`` then ``ng_run`` on a config made of the wheel's own configs.

The config is what a new user writes: the nemo-gym wheel's shipped configs for the model
(``vllm_model``), the agent (``simple_agent``) and the environment (``single_agent_turn``) in
``config_paths``, the wheel's block of the resources server (``example_single_tool_call``), and
only the keys they leave to the user (the backend, which servers refer to which); no server has
a port, an entrypoint of the plugin or a ``checkpoint:`` block. ``ng-checkpoint enable`` wraps
every server, pins a free port for each (and says so), adds the ``checkpoint:`` block, and
``ng_run`` starts the config it wrote.

Ray stays on loopback twice over. Everything runs inside a network namespace holding only a
loopback interface (``netns_support``), and Ray is docs/ng_run.md's recipe: the test starts it with
``ray start --head --node-ip-address=127.0.0.1`` and ``ng_run`` joins it through Gym's own
``ray_head_node_address`` (it would otherwise start its own cluster on the address Ray picks).
The test reads every listening socket of the namespace and checks it is on 127.0.0.1.
The fake inference backend stands in for vLLM on port 18000. The scenario
is the demo's (``crash_scenario``): rollouts in flight are checkpointed with the
coordination library, ``ng_run``, its servers and the backend are SIGKILLed, a fresh
``ng_run`` starts, the checkpoint is restored and every rollout finishes without repeating
a step. Then ``ng_run`` is stopped as Ctrl-C stops it, the backend and the Ray cluster
the test started are stopped by pid, and no process is left in the namespace.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import nemo_gym
import orjson
import pytest
import yaml
from netns_support import LoopbackNamespace, namespaces_supported

from nemo_gym_checkpoint_plugin.cli._enable import LAUNCH_ENTRYPOINT, PTH_NAME
from nemo_gym_checkpoint_plugin.testing.crash_scenario import run_scenario
from nemo_gym_checkpoint_plugin.testing.gym_config import BACKEND, GYM_SERVERS, TOKEN_ENV, server_location
from nemo_gym_checkpoint_plugin.testing.harness import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        sys.platform != "linux" or not namespaces_supported(),
        reason="needs a network namespace (Linux, root) to keep Ray on loopback",
    ),
]

# Where the wheel installs its servers (resources_servers/, responses_api_models/, ... beside nemo_gym/).
WHEEL = Path(nemo_gym.__file__).resolve().parent.parent
BACKEND_PORT = 18000
HEAD_SERVER_PORT = 11000  # Gym's default: the config gives none
# The console script, run by this interpreter: Gym's legacy shim reads the command from argv[0].
NG_RUN = str(Path(sys.executable).parent / "ng_run")
RAY = str(Path(sys.executable).parent / "ray")
RAY_PORT = 6379
RAY_STOP_GRACE = 16.0  # ray stop's own grace period before it force-kills
NG_CHECKPOINT = [sys.executable, "-m", "nemo_gym_checkpoint_plugin.cli"]
TOKEN = "ng-run-test-token"
START_TIMEOUT = 420.0


def wheel_config(work: Path) -> Path:
    """A Gym config made of the wheel's shipped configs, no server given a port (what ``enable`` starts from)."""
    shipped = yaml.safe_load(
        (WHEEL / "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml").read_text()
    )
    config = {
        "config_paths": [
            "responses_api_models/vllm_model/configs/vllm_model.yaml",
            "responses_api_agents/simple_agent/configs/simple_agent.yaml",
            "environment_servers/single_agent_turn/configs/single_agent_turn.yaml",
        ],
        "policy_base_url": f"http://127.0.0.1:{BACKEND_PORT}/v1",
        "policy_api_key": "fake-key",
        "policy_model_name": "fake-model",
        # Only the resources server itself: its shipped file also defines two servers this scenario does not use.
        "example_single_tool_call": shipped["example_single_tool_call"],
        # What the shipped configs leave to the user (??? in them), and the fake backend's reply format.
        "policy_model": {"responses_api_models": {"vllm_model": {"uses_reasoning_parser": False}}},
        "simple_agent": {
            "responses_api_agents": {
                "simple_agent": {"resources_server": {"type": "resources_servers", "name": "example_single_tool_call"}}
            }
        },
        "single_agent_turn": {
            "environment_servers": {
                "single_agent_turn": {
                    "resources_server": {"type": "resources_servers", "name": "example_single_tool_call"},
                    "agent_server": {"type": "responses_api_agents", "name": "simple_agent"},
                    "resources_tool_transports": ["direct_http"],
                    "cleanup_timeout_seconds": 30,
                }
            }
        },
    }
    for name in GYM_SERVERS:
        assert not {"port", "host"} & set(server_location(config, name)[2]), name
    path = work / "gym_config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def _urls(config: Path) -> dict[str, str]:
    written = yaml.safe_load(config.read_text(encoding="utf-8"))
    urls = {BACKEND: f"http://127.0.0.1:{BACKEND_PORT}"}
    for name in GYM_SERVERS:
        inner = server_location(written, name)[2]
        urls[name] = f"http://{inner['host']}:{inner['port']}"
    return urls


class NgRunDeployment:
    """What ``run_scenario`` needs of a deployment, for the servers ``ng_run`` starts in the namespace."""

    def __init__(self, ns: LoopbackNamespace, work: Path, env: dict[str, str], config: Path) -> None:
        self.ns, self.work, self.env = ns, work, env
        self.urls = _urls(config)
        self.config = str(config)
        self.launcher: subprocess.Popen | None = None
        self.backend: subprocess.Popen | None = None
        self.children: list[subprocess.Popen] = []
        self.ray: list[int] = []
        self.starts = 0

    def start_ray(self) -> None:
        """docs/ng_run.md's recipe: a Ray head bound to 127.0.0.1 (no dashboard), which ng_run joins."""
        before = set(self.ns.processes())
        started = self.ns.command(
            [
                sys.executable,
                RAY,
                "start",
                "--head",
                "--node-ip-address=127.0.0.1",
                f"--port={RAY_PORT}",
                "--include-dashboard=false",
                "--num-cpus=1",
                "--disable-usage-stats",
            ],
            timeout=240,
            env=self.env,
        )
        assert started.returncode == 0, started.stdout + started.stderr
        self.ray = sorted(set(self.ns.processes()) - before)
        assert self.ray, "ray start left no process"

    @property
    def process_groups(self) -> dict[str, int]:
        return {"ng_run": self.launcher.pid} if self.launcher else {}

    def _spawn(self, argv: list[str], log_name: str, **kwargs: Any) -> subprocess.Popen:
        with open(self.work / log_name, "ab") as log:  # the child keeps its own descriptor
            child = self.ns.popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, **kwargs)
        self.children.append(child)
        return child

    def start(self) -> None:
        """The backend, then ``ng_run`` on the config ``enable`` wrote, from the directory ``enable`` ran in.

        Returns once every server answers. A fresh backend each time, as after a real crash: its
        counters are what the scenario reads to find steps that ran twice.
        """
        self.starts += 1
        self.env["PYTHONUNBUFFERED"] = "1"  # ng_run's "servers ready" line reaches its log when printed
        self.backend = self._spawn(
            [
                sys.executable,
                "-m",
                "nemo_gym_checkpoint_plugin.testing.fake_backend",
                "--host",
                "127.0.0.1",
                "--port",
                str(BACKEND_PORT),
            ],
            f"backend-{self.starts}.log",
        )
        log_path = self.work / f"ng_run-{self.starts}.log"
        # Its own session: Ctrl-C in a terminal signals the whole foreground group, and so can the test.
        self.launcher = self._spawn(
            [sys.executable, NG_RUN, f"+config_paths=[{self.config}]", f"+ray_head_node_address=127.0.0.1:{RAY_PORT}"],
            log_path.name,
            cwd=self.work,
            start_new_session=True,
        )

        def ready() -> bool:
            if self.launcher.poll() is not None:
                raise AssertionError(f"ng_run exited {self.launcher.returncode}:\n{log_path.read_text()[-4000:]}")
            # ng_run's own readiness wait is over (a Ctrl-C during it exits 1): its line, then every status.
            if "servers ready!" not in log_path.read_text(errors="replace"):
                return False
            status = self.ns.command(
                [*NG_CHECKPOINT, "status", "--config", self.config, "--json", "--probe-timeout", "1", "--tries", "1"],
                timeout=60,
                env=self.env,
            )
            return status.returncode == 0

        wait_until(ready, START_TIMEOUT, "every server ng_run started to answer its status")

    def kill(self) -> None:
        """The crash: SIGKILL ng_run's process group (it and its servers) and the backend; Ray stays up."""
        group = self.launcher.pid
        os.killpg(group, signal.SIGKILL)
        self.backend.kill()
        for child in self.children:
            child.wait(30)

        def gone() -> bool:
            return not any(_pgid(pid) == group for pid in self.ns.processes())

        wait_until(gone, 60, "every process of the crashed ng_run to be gone")

    def stop_ray(self) -> None:
        """Stop the Ray cluster this test started, by its pids, as ``ray stop`` does: SIGTERM, then SIGKILL.

        (``ray stop`` itself is not used: it finds Ray processes by name, machine-wide.)
        """
        for pid in self.ray:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            wait_until(lambda: self.ns.processes() == [], RAY_STOP_GRACE, "Ray to exit on SIGTERM")
        except AssertionError:
            _kill_all(self.ns)  # what is left is the test's own Ray cluster (its gcs_server may outlive a SIGTERM)

    def reap(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
            child.wait(30)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _kill_all(ns: LoopbackNamespace) -> None:
    # Only processes inside this namespace, each by its pid.
    for pid in ns.processes():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def namespace():
    ns = LoopbackNamespace()
    yield ns
    _kill_all(ns)  # whatever a failed test left
    ns.close()


def test_enable_then_ng_run_starts_the_wheels_configs_without_ports_and_checkpoints_and_restores(namespace, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    source = wheel_config(work)
    # 1. enable: every server wrapped, a free port pinned for each (said), the checkpoint block added;
    # each server's venv imports the plugin.
    enabled = subprocess.run(
        [*NG_CHECKPOINT, "enable", str(source), "--json"], cwd=work, capture_output=True, text=True, timeout=300
    )
    assert enabled.returncode == 0, enabled.stderr
    done = orjson.loads(enabled.stdout)
    config = work / "gym_config.checkpointed.yaml"
    assert done["written"] == str(config) and done["config"] == str(config)
    assert sorted(done["ports_chosen"]) == sorted(GYM_SERVERS)
    for name, port in done["ports_chosen"].items():
        assert f"{name}: no port in the config, pinned to {port}" in " ".join(done["warnings"])
    written = yaml.safe_load(config.read_text(encoding="utf-8"))
    assert written["checkpoint"] == {"enabled": True, "control_auth_token_env": TOKEN_ENV}
    for name in GYM_SERVERS:
        inner = server_location(written, name)[2]
        assert inner["entrypoint"] == LAUNCH_ENTRYPOINT and inner["port"] == done["ports_chosen"][name]
    assert sorted(s["name"] for s in done["servers"]) == sorted(GYM_SERVERS)
    for server in done["servers"]:
        venv = Path(server["venv"])
        assert venv == work / server["type"] / server["implementation"] / ".venv"
        assert server["action"] == "created, layered on this environment"
        assert list(venv.glob(f"lib/python*/site-packages/{PTH_NAME}"))

    ray_tmp = tempfile.mkdtemp(prefix="ngray-")  # short: Ray's unix socket paths must fit 107 bytes
    home = work / "home"
    home.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "NG_CHECKPOINT"))},
        TOKEN_ENV: TOKEN,
        "RAY_TMPDIR": ray_tmp,
        "RAY_USAGE_STATS_ENABLED": "0",
        "HOME": str(home),
    }
    deployment = NgRunDeployment(namespace, work, env, config)
    try:
        deployment.start_ray()
        deployment.start()
        status = namespace.command([*NG_CHECKPOINT, "status", "--config", str(config), "--json"], timeout=60, env=env)
        participants = orjson.loads(status.stdout)["participants"]
        assert sorted((p["name"], p["kind"], p["phase"]) for p in participants) == [
            ("example_single_tool_call", "resources", "idle"),
            ("policy_model", "model", "idle"),
            ("simple_agent", "agent", "idle"),
            ("single_agent_turn", "environment", "idle"),
        ]
        # ng_run, every server it started and Ray are in the namespace: nothing listens beyond loopback.
        inside = namespace.processes()
        assert deployment.launcher.pid in inside and len(inside) > 6
        listening = namespace.listening(deployment.launcher.pid)
        ports = {BACKEND_PORT, HEAD_SERVER_PORT, RAY_PORT, *done["ports_chosen"].values()}
        assert {port for _a, port in listening} >= ports
        assert [a for a, _p in listening if not namespace.is_loopback(a)] == []
        assert "Connecting to Ray cluster at specified address: 127.0.0.1" in (work / "ng_run-1.log").read_text()

        checkpoint_dir = work / "ckpt"
        result = namespace.run(
            run_scenario(deployment, checkpoint_dir, TOKEN, ["cont-1", "cont-2"], ["rst-1"], timeout=START_TIMEOUT),
            timeout=3 * START_TIMEOUT,
        )
        summary = result.summary()
        assert deployment.starts == 2  # the restore ran against a fresh ng_run
        assert summary["finished"] == 3 and summary["lost"] == 0 and summary["reward_1"] == 3
        assert summary["continued"] == 2 and summary["restarted"] == 1
        assert summary["repeated_steps"] == 0
        assert sorted(result.restored) == ["cont-1-a1", "cont-2-a1"]
        verified = subprocess.run(
            [*NG_CHECKPOINT, "verify", str(checkpoint_dir)], capture_output=True, text=True, timeout=120
        )
        assert verified.returncode == 0, verified.stdout + verified.stderr

        # 3. Stop as Ctrl-C does (SIGINT to ng_run's foreground group): ng_run and every server exit.
        group = deployment.launcher.pid
        os.killpg(group, signal.SIGINT)
        assert deployment.launcher.wait(120) == 0
        wait_until(
            lambda: not any(_pgid(pid) == group for pid in namespace.processes()),
            60,
            "every process ng_run started to exit",
        )
        # Then what the test started itself: the backend, and the Ray cluster. Nothing is left.
        deployment.backend.terminate()
        deployment.backend.wait(30)
        deployment.stop_ray()
        wait_until(lambda: namespace.processes() == [], 120, "no process left in the namespace")
    finally:
        _kill_all(namespace)
        deployment.reap()
        shutil.rmtree(ray_tmp, ignore_errors=True)
