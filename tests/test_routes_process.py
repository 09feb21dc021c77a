"""The control routes served by a real uvicorn process on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from control_support import INSTANCE, KIND, wire

from nemo_gym_checkpoint_plugin._routes import CONTROL_PREFIX

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent
TOKEN = "process-token-" + os.urandom(8).hex()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def server() -> Iterator[str]:
    port = _free_port()
    env = {**os.environ, "NG_CHECKPOINT_TEST_TOKEN": TOKEN, "RAY_USAGE_STATS_ENABLED": "0"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "control_server_app:make_app",
            "--factory",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        cwd=TESTS,
        env=env,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                raise AssertionError(f"the server exited with {process.returncode} before it served")
            try:
                if httpx.get(f"{base}{CONTROL_PREFIX}/status", timeout=1).status_code == 401:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > end:
                raise AssertionError("the server did not answer within 30 s")
            time.sleep(0.05)  # wait-ok: polling interval of the bounded readiness wait above
        yield base
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def test_checkpoint_over_a_real_server(server: str, tmp_path: Path) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=f"{server}{CONTROL_PREFIX}", timeout=10) as client:
        assert client.get("/status").status_code == 401
        assert (
            client.post(
                "/prepare",
                json={"checkpoint_id": "c1", "deadline_ts": time.time() + 10},
                headers={"Authorization": "Bearer wrong"},
            ).status_code
            == 401
        )
        status = client.get("/status", headers=auth).json()
        assert (status["kind"], status["instance"], status["phase"]) == (KIND, INSTANCE, "idle")
        body = {"checkpoint_id": "c1", "deadline_ts": time.time() + 10}
        assert client.post("/prepare", json=body, headers=auth).json()["phase"] == "prepared"
        commit = client.post(
            "/commit",
            headers=auth,
            json={**body, "checkpoint_dir": str(tmp_path), "episode_ids": [wire("r1"), wire("r2-a1")]},
        ).json()
        assert commit["episode_ids"] == ["r1", "r2-a1"] and commit["manifest"]["record_count"] == 2
        assert (tmp_path / "gym" / KIND / INSTANCE / "manifest.json").exists()
        assert client.post("/resume", json=body, headers=auth).json() == {"phase": "idle", "idempotent": False}
        stale = client.post("/prepare", json=body, headers=auth)
        assert stale.status_code == 409 and stale.json()["error"]["code"] == "stale_checkpoint"
        assert client.post("/prepare", json={**body, "extra": 1}, headers=auth).status_code == 422
