"""No server outlives the test run that started it, however the run ends (``testing.reaper``).

Each case runs a real pytest (with the testing kit's plugin) whose one test starts a real
uvicorn server (the fake backend) leading a session of its own, the way the kit starts Gym
servers, and never stops it: the run is either SIGKILLed while the test waits (no ``finally``,
no pytest hook runs) or ends normally. Either way the server must be gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from nemo_gym_checkpoint_plugin.testing.harness import wait_until
from nemo_gym_checkpoint_plugin.testing.ports import free_port_base

pytestmark = pytest.mark.slow

BOUND = 180.0

_INNER = """
import os, subprocess, sys, threading, urllib.request
from pathlib import Path

from nemo_gym_checkpoint_plugin.testing.harness import wait_until

def answers(url):
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False

def test_leaves_a_server_running():
    server = subprocess.Popen(
        [sys.executable, "-m", "nemo_gym_checkpoint_plugin.testing.fake_backend", "--host", "127.0.0.1",
         "--port", os.environ["LEAK_PORT"]],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = "http://127.0.0.1:" + os.environ["LEAK_PORT"] + "/v1/models"
    wait_until(lambda: answers(url), 120.0, "the server answering")
    Path(os.environ["LEAK_PID_FILE"]).write_text(str(server.pid))
    if os.environ["LEAK_MODE"] == "hang":
        threading.Event().wait()  # until the outer test kills this run
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited: only its parent's reaping is missing.
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
            return True
    except OSError:
        return False


def _run_inner(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[bytes], int, int]:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(_INNER))
    port = free_port_base(1)
    pid_file = tmp_path / "server.pid"
    env = {**os.environ, "LEAK_PORT": str(port), "LEAK_PID_FILE": str(pid_file), "LEAK_MODE": mode}
    inner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "nemo_gym_checkpoint_plugin.testing.pytest_plugin",
            str(tmp_path / "test_inner.py"),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    server = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), BOUND, "the inner test's server"))
    return inner, server, port


@pytest.mark.parametrize("mode", ["hang", "leave"])
def test_a_server_a_test_left_dies_with_the_run(tmp_path: Path, mode: str) -> None:
    inner, server, port = _run_inner(tmp_path, mode)
    try:
        if mode == "hang":
            assert _answers(port)
            # pytest killed outright: no hook, no finally; only the watchdog is left to act.
            inner.send_signal(signal.SIGKILL)
            inner.wait(BOUND)
        else:
            output = inner.communicate(timeout=BOUND)[0].decode()
            assert inner.returncode == 0, output
            assert f"reaper: killed 1 process(es) the tests left running: [{server}]" in output
        wait_until(lambda: not _alive(server), BOUND, "the leaked server gone")
        assert not _answers(port)
    finally:
        if inner.poll() is None:
            inner.kill()
        inner.communicate(timeout=BOUND)  # reaps it and closes its pipe
        if _alive(server):
            os.killpg(server, signal.SIGKILL)
