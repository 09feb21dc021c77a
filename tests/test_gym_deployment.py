"""A real Gym deployment from the nemo-gym wheel (no Ray, 127.0.0.1 only), its fake backend, and ``make serve``."""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from nemo_gym_checkpoint_plugin.testing.deployment import (
    AGENT,
    BACKEND,
    ENVIRONMENT,
    GYM_SERVERS,
    MODEL,
    RESOURCES,
    TOKEN_ENV,
    port_is_free,
)
from nemo_gym_checkpoint_plugin.testing.harness import (
    GymHarness,
    children_of,
    free_port_base,
    pid_alive,
    processes_in_groups,
    send_rollout,
    send_wave,
    wait_until,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def _assert_rewarded(reply: dict, rollout_id: str) -> None:
    assert reply["failure"] is None, reply["failure"]
    assert reply["episode_id"] == {"rollout_id": rollout_id, "attempt": 0}
    assert reply["result"]["reward"] == 1.0
    tool_calls = [item for item in reply["result"]["response"]["output"] if item["type"] == "function_call"]
    assert [call["name"] for call in tool_calls] == ["get_weather"]


async def test_a_wave_of_rollouts_finishes_with_reward_one(gym_deployment: GymHarness) -> None:
    ids = [f"wave-{i}" for i in range(12)]
    replies = await send_wave(gym_deployment.env_url, ids)
    for rollout_id, reply in zip(ids, replies, strict=True):
        _assert_rewarded(reply, rollout_id)
    stats = await gym_deployment.fake.stats()
    for rollout_id in ids:
        (conversation,) = [c for c in stats["calls"] if f"(rollout {rollout_id})" in c]
        # One tool call, then one final answer: each step exactly once.
        assert stats["calls"][conversation] == {"0": 1, "1": 1}
        assert stats["completed"][conversation] == {"0": 1, "1": 1}


def test_servers_run_without_ray_and_with_the_checkpoint_block(gym_deployment: GymHarness) -> None:
    deployment = gym_deployment.deployment
    assert set(deployment.urls) == {BACKEND, *GYM_SERVERS}
    assert all(url.startswith("http://127.0.0.1:") for url in deployment.urls.values())
    # The top-level block passes through Gym's parser and every server started with it in its config.
    assert deployment.config["checkpoint"]["enabled"] is True
    assert deployment.config["checkpoint"]["control_auth_token_env"] == TOKEN_ENV
    assert "checkpoint:" in deployment.config_yaml
    env_server = deployment.config[ENVIRONMENT]["environment_servers"]["single_agent_turn"]
    assert env_server["entrypoint"] == "nemo_gym_checkpoint_plugin._ray_off"
    # Ray would show as helper processes (gcs_server, raylet...) under a server: each is alone.
    for name, proc in deployment.processes.items():
        assert children_of(proc.pid) == [], f"{name} has child processes"
        assert processes_in_groups([proc.pid]) == [proc.pid], f"{name}'s group holds other processes"


async def test_a_held_backend_call_keeps_rollouts_in_flight_until_released(gym_deployment: GymHarness) -> None:
    fake = gym_deployment.fake
    ids = [f"held-{i}" for i in range(4)]
    # Hold the second model call (after the tool round trip) of each of these rollouts.
    await fake.hold(match="(rollout held-", count=len(ids), step=1)
    wave = asyncio.create_task(send_wave(gym_deployment.env_url, ids))
    try:
        stats = await fake.wait_for(lambda s: s["held"] == len(ids), timeout=60, what="4 held calls")
        assert not wave.done()
        held = sorted(call["conversation"] for call in stats["held_calls"])
        assert held == sorted(f"what's it like in sf? (rollout {r})" for r in ids)
        assert {call["step"] for call in stats["held_calls"]} == {1}
        for conversation in held:
            assert stats["completed"][conversation] == {"0": 1}
    finally:
        released = await fake.release(match="(rollout held-")
    assert released["released"] == len(ids)
    replies = await asyncio.wait_for(wave, timeout=60)
    for rollout_id, reply in zip(ids, replies, strict=True):
        _assert_rewarded(reply, rollout_id)
    stats = await fake.stats()
    assert stats["held"] == 0
    assert not [r for r in stats["repeated"] if "(rollout held-" in r["conversation"]]


async def test_sigkill_of_every_group_leaves_nothing_and_a_fresh_start_serves(gym_deployment_factory) -> None:
    harness: GymHarness = gym_deployment_factory()
    await harness.fake.hold(match="(rollout doomed)", count=1, step=1)
    in_flight = asyncio.create_task(send_rollout(harness.env_url, "doomed"))
    await harness.fake.wait_for(lambda s: s["held"] == 1, timeout=60, what="the doomed rollout's held call")
    pids = [proc.pid for proc in harness.deployment.processes.values()]

    groups = harness.crash()

    assert sorted(groups) == sorted([BACKEND, *GYM_SERVERS])
    assert processes_in_groups(groups.values()) == []
    assert not [pid for pid in pids if pid_alive(pid)]
    with pytest.raises(aiohttp.ClientConnectionError):
        await asyncio.wait_for(in_flight, timeout=30)
    ports = [int(url.rsplit(":", 1)[1]) for url in harness.urls.values()]
    assert all(port_is_free(port) for port in ports)

    harness.restart()

    assert [int(url.rsplit(":", 1)[1]) for url in harness.urls.values()] == ports
    assert not set(pids) & {proc.pid for proc in harness.deployment.processes.values()}
    replies = await send_wave(harness.env_url, ["after-crash-0", "after-crash-1"])
    _assert_rewarded(replies[0], "after-crash-0")
    _assert_rewarded(replies[1], "after-crash-1")
    assert (await harness.fake.stats())["calls_total"] == 4  # a fresh backend: only the new wave's calls


def _stdout_until(proc: subprocess.Popen[bytes], timeout: float, found: Callable[[bytes], Any]) -> Any:
    """Read ``proc``'s stdout until ``found(everything read)`` is not None, waiting at most ``timeout``."""
    assert proc.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buffered = b""
    try:
        while (answer := found(buffered)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or proc.poll() is not None:
                raise AssertionError(f"no line of the expected kind (status {proc.poll()}); got {buffered!r}")
            if selector.select(timeout=remaining):
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    raise AssertionError(f"stdout closed after {buffered!r}")
                buffered += chunk
    finally:
        selector.close()
    return answer


def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    """The first line of ``proc``'s stdout (and nothing after it), waiting at most ``timeout``."""
    buffered = _stdout_until(proc, timeout, lambda out: out if b"\n" in out else None)
    line, _, rest = buffered.partition(b"\n")
    assert rest == b"", f"serve printed more than one line: {rest!r}"
    return line


async def test_serve_prints_one_json_line_serves_and_stops_on_a_double_sigterm(tmp_path: Path) -> None:
    port_base = free_port_base()
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env.update(PORT_BASE=str(port_base), NG_SERVE_DIR=str(tmp_path / "serve"))
    with open(tmp_path / "serve.stderr", "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nemo_gym_checkpoint_plugin.testing.serve"],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
        )
    pgid = proc.pid
    try:
        # A bound, not a wait: serve starts five processes, which takes minutes on a loaded 2-core machine.
        line = json.loads(_read_line(proc, timeout=300))
        names = (BACKEND, MODEL, AGENT, RESOURCES, ENVIRONMENT)
        assert line["servers"] == {name: f"http://127.0.0.1:{port_base + i}" for i, name in enumerate(names)}
        assert line["token_env"] == TOKEN_ENV
        assert line["token_file"] == str(tmp_path / "serve" / "token")
        config_text = Path(line["config"]).read_text()
        assert "checkpoint:" in config_text and "control_auth_token_env: NG_CHECKPOINT_TOKEN" in config_text
        token_file = tmp_path / "serve" / "token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        assert token_file.read_text().strip() not in json.dumps(line)
        # Every server stays in serve's own process group: serve plus five children.
        assert len(processes_in_groups([pgid])) == 6

        _assert_rewarded(await send_rollout(line["servers"][ENVIRONMENT], "served"), "served")
        # Every Gym server is a checkpoint participant reachable with the generated token.
        headers = {"Authorization": f"Bearer {token_file.read_text().strip()}"}
        kinds = {}
        async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
            for name in (MODEL, AGENT, RESOURCES, ENVIRONMENT):
                reply = await http.get(f"{line['servers'][name]}/ng-control/v1/checkpoint/status", headers=headers)
                assert reply.status_code == 200, (name, reply.text)
                kinds[name] = (reply.json()["kind"], reply.json()["phase"])
        assert kinds == {
            MODEL: ("model", "idle"),
            AGENT: ("agent", "idle"),
            RESOURCES: ("resources", "idle"),
            ENVIRONMENT: ("environment", "idle"),
        }

        os.killpg(pgid, signal.SIGTERM)
        os.killpg(pgid, signal.SIGTERM)  # what make forwards on top of the group's signal
        assert proc.wait(timeout=20) == 0
        wait_until(lambda: not processes_in_groups([pgid]), timeout=10, what="serve's children to be gone")
        assert all(port_is_free(port_base + i) for i in range(len(names)))
    finally:
        if proc.poll() is None:
            os.killpg(pgid, signal.SIGKILL)
            proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


def _serve_env(tmp_path: Path, port_base: int, serve_dir: str = "serve") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    env.update(PORT_BASE=str(port_base), NG_SERVE_DIR=str(tmp_path / serve_dir))
    return env


def _read_json_line(proc: subprocess.Popen[bytes], timeout: float) -> dict:
    """The first stdout line of ``proc`` that is a JSON object (make echoes its recipe first)."""

    def json_line(out: bytes) -> dict | None:
        for line in out.splitlines(keepends=True):
            if line.startswith(b"{") and line.endswith(b"\n"):
                return json.loads(line)
        return None

    return _stdout_until(proc, timeout, json_line)


def test_sigterm_to_make_serve_alone_stops_every_server(tmp_path: Path) -> None:
    port_base = free_port_base()
    # `-o setup`: the venv is this one; the test is about serve, not about (re)installing it.
    with open(tmp_path / "make.stderr", "wb") as stderr:
        make = subprocess.Popen(
            ["make", "--no-print-directory", "-o", "setup", "serve", f"PORT_BASE={port_base}", f"PY={sys.executable}"],
            cwd=REPO,
            env=_serve_env(tmp_path, port_base),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
        )
    pgid = make.pid
    try:
        line = _read_json_line(make, timeout=300)
        assert len(line["servers"]) == 5
        assert len(processes_in_groups([pgid])) >= 7  # make, serve and five servers

        os.kill(make.pid, signal.SIGTERM)  # make alone: not its group, as `kill <pid of make>` does

        make.wait(timeout=30)
        wait_until(lambda: not processes_in_groups([pgid]), timeout=30, what="every server to be gone")
        assert all(port_is_free(port_base + i) for i in range(5))
        assert "every server stopped" in (tmp_path / "make.stderr").read_text()
    finally:
        if processes_in_groups([pgid]):
            os.killpg(pgid, signal.SIGKILL)
        if make.poll() is None:
            make.wait(timeout=10)
        assert make.stdout is not None
        make.stdout.close()


def test_a_second_serve_on_a_busy_port_base_fails_and_changes_nothing(tmp_path: Path) -> None:
    port_base = free_port_base()
    serve = [sys.executable, "-m", "nemo_gym_checkpoint_plugin.testing.serve"]
    with open(tmp_path / "first.stderr", "wb") as stderr:
        first = subprocess.Popen(
            serve,
            cwd=REPO,
            env=_serve_env(tmp_path, port_base),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        line = _read_json_line(first, timeout=300)
        token_file, config = Path(line["token_file"]), Path(line["config"])
        before = {path: path.read_bytes() for path in (token_file, config)}
        stat_before = {path: path.stat().st_mtime_ns for path in before}

        # The same work dir (what the default NG_SERVE_DIR gives for one PORT_BASE): the lock refuses it.
        same = subprocess.run(
            serve, cwd=REPO, env=_serve_env(tmp_path, port_base), capture_output=True, text=True, timeout=120
        )
        # Another work dir on the same ports: the port check refuses it, before writing its own files.
        other = subprocess.run(
            serve, cwd=REPO, env=_serve_env(tmp_path, port_base, "other"), capture_output=True, text=True, timeout=120
        )

        assert same.returncode == 2 and other.returncode == 2
        assert same.stdout == other.stdout == ""
        assert "another serve is running" in same.stderr and f"PORT_BASE={port_base}" in same.stderr
        assert f"PORT_BASE={port_base} is busy" in other.stderr
        assert "Traceback" not in same.stderr + other.stderr
        assert {path: path.read_bytes() for path in before} == before
        assert {path: path.stat().st_mtime_ns for path in before} == stat_before
        assert not (tmp_path / "other" / "token").exists() and not (tmp_path / "other" / "gym_config.yaml").exists()
        # The first one still serves, with the token it wrote.
        headers = {"Authorization": f"Bearer {token_file.read_text().strip()}"}
        reply = httpx.get(
            f"{line['servers'][ENVIRONMENT]}/ng-control/v1/checkpoint/status",
            headers=headers,
            timeout=30,
            trust_env=False,
        )
        assert reply.status_code == 200, reply.text
        assert first.poll() is None
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(timeout=10)
        assert first.stdout is not None
        first.stdout.close()
