"""``ng-checkpoint`` driving real participant servers by hand, as an operator would from a shell."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import orjson
import pytest
import yaml
from coord_support import FOUR, TOKEN, config_for, four_participants, start_participants, stop_participants

pytestmark = pytest.mark.slow

NG_CHECKPOINT = [sys.executable, "-m", "nemo_gym_checkpoint_plugin.cli"]
TOKEN_ENV = "COORD_CLI_TOKEN"


@pytest.fixture
def four(tmp_path):
    servers = four_participants(tmp_path)
    yield servers
    stop_participants(servers)


def cli(*args: str, env_token: bool = True, **extra_env: str) -> subprocess.CompletedProcess:
    # The CLI's own variables come only from the test that sets them.
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, "NG_CHECKPOINT_TOKEN", "NG_CHECKPOINT_CONFIG")}
    env.update({TOKEN_ENV: TOKEN} if env_token else {}, COLUMNS="80", **extra_env)
    done = subprocess.run([*NG_CHECKPOINT, *args], capture_output=True, text=True, timeout=120, env=env)
    # The token is never printed, whatever happened.
    assert TOKEN not in done.stdout and TOKEN not in done.stderr
    return done


def urls(servers) -> list[str]:
    return [arg for s in servers for arg in ("--url", s.url)]


def test_drive_a_checkpoint_by_hand_then_verify_it(four, tmp_path):
    where = [*urls(four), "--token-env", TOKEN_ENV]
    ckpt = tmp_path / "ckpt"

    status = cli("status", *where)
    assert status.returncode == 0, status.stderr
    header, *rows = status.stdout.splitlines()
    assert header.split() == ["NAME", "KIND", "PHASE", "CHECKPOINT", "LEASE", "NOTES"]
    assert sorted(row.split()[1] for row in rows) == ["agent", "environment", "model", "resources"]
    assert all(row.split()[2] == "idle" for row in rows)

    prepared = cli("prepare", "step-1", *where, "--deadline", "20")
    assert prepared.returncode == 0, prepared.stderr
    assert "prepared step-1: ready" in prepared.stdout
    assert "restarts (leave them out of the commit scope): r3\n" in prepared.stdout
    # The progress display: one line per participant reply, in the prepare order.
    progress = [line.split() for line in prepared.stderr.splitlines() if line.strip().startswith("[")]
    assert [(line[0], line[2]) for line in progress] == [
        ("[1/4]", "environment"),
        ("[2/4]", "model"),
        ("[3/4]", "agent"),
        ("[4/4]", "resources"),
    ]

    status = orjson.loads(cli("status", *where, "--json").stdout)
    assert {p["phase"] for p in status["participants"]} == {"prepared"}
    assert {p["checkpoint_id"] for p in status["participants"]} == {"step-1"}

    committed = cli("commit", "step-1", *where, "--dir", str(ckpt), "--episode", "r1", "--episode", "r2-a1")
    assert committed.returncode == 0, committed.stderr
    renewed = cli("renew", "step-1", *where, "--json")
    assert renewed.returncode == 0 and len(orjson.loads(renewed.stdout)) == 4
    resumed = cli("resume", "step-1", *where)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed step-1 on 4 participant(s)" in resumed.stdout

    verified = cli("verify", str(ckpt))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.count("step-1  2 records") == 4
    inspected = orjson.loads(cli("inspect", str(ckpt), "--episodes", "--json").stdout)
    assert {tuple(p["episodes"]) for p in inspected["participants"]} == {("r1", "r2-a1")}

    keys = tmp_path / "keys.txt"
    keys.write_text("r1  # first\nr2-a1\n")
    restored = cli("restore", "restore-1", *where, "--dir", str(ckpt), "--episodes-file", str(keys), "--json")
    assert restored.returncode == 0, restored.stderr
    assert orjson.loads(restored.stdout)["restored"] == ["r1-a1", "r2-a2"]
    retired = cli("retire", "restore-1", *where, "--episode", "r1-a1")
    assert retired.returncode == 0, retired.stderr
    assert cli("resume", "restore-1", *where).returncode == 0
    forgot = cli("forget", "forget-1", *where, "--rollout", "r1")
    assert forgot.returncode == 0 and "forgot 1 rollout(s) on 4 participant(s)" in forgot.stdout


def test_config_gives_servers_and_token(four, tmp_path):
    config = tmp_path / "gym.yaml"
    config.write_text(yaml.safe_dump(config_for(four, token_env=TOKEN_ENV)))
    status = cli("status", "--config", str(config), "--json")
    assert status.returncode == 0, status.stderr
    assert sorted(p["name"] for p in orjson.loads(status.stdout)["participants"]) == sorted(s.name for s in four)
    # The variable the config names is unset: a clear usage error, naming the key.
    missing = cli("status", "--config", str(config), env_token=False)
    assert missing.returncode == 2 and "control_auth_token_env" in missing.stderr


def test_prepare_not_ready_exits_3_and_commit_failure_names_the_server(tmp_path):
    specs = [dict(spec) for spec in FOUR[:2]]
    specs[1]["blockers"] = ["r5"]
    servers = start_participants(tmp_path, specs)
    try:
        where = [*urls(servers), "--token-env", TOKEN_ENV]
        prepared = cli("prepare", "step-1", *where, "--deadline", "1")
        assert prepared.returncode == 3
        assert "NOT ready: stopped at model, 1 blocker(s): r5; not reached: none." in prepared.stdout
        # Commit while the model is still preparing: refused, and the error names it and its code.
        committed = cli("commit", "step-1", *where, "--dir", str(tmp_path / "c"), "--all")
        assert committed.returncode == 1
        model = servers[1]
        assert f"{model.name} [{model.url}] commit: invalid_phase (HTTP 409)" in committed.stderr
        assert cli("resume", "step-1", *where).returncode == 0
    finally:
        stop_participants(servers)


def test_status_reports_a_down_server(tmp_path):
    servers = start_participants(tmp_path, [dict(FOUR[1])])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        status = cli(
            "status", *urls(servers), "--url", down, "--token-env", TOKEN_ENV, "--probe-timeout", "0.5", "--tries", "2"
        )
        assert status.returncode == 1
        assert any(
            row.startswith(down) and row.split()[2:] == ["ERROR", "-", "-", "unreachable"]
            for row in status.stdout.splitlines()
        )
        assert f"error: {down} [{down}] status: unreachable" in status.stderr
        # The deployment is still listed.
        assert any(" model " in row and " idle " in row for row in status.stdout.splitlines())
    finally:
        stop_participants(servers)


def test_usage_errors(tmp_path):
    assert cli("status", "--token-env", TOKEN_ENV).returncode == 2  # no --config and no --url
    no_token = cli("status", "--url", "http://127.0.0.1:9", env_token=False)
    assert no_token.returncode == 2 and "no control token" in no_token.stderr
    empty_scope = cli("commit", "x", "--url", "http://127.0.0.1:9", "--token-env", TOKEN_ENV, "--dir", "/tmp")
    assert empty_scope.returncode == 2 and "commit needs its scope" in empty_scope.stderr
    unreachable = cli(
        "commit",
        "x",
        "--url",
        "http://127.0.0.1:9",
        "--token-env",
        TOKEN_ENV,
        "--dir",
        "/tmp",
        "--all",
        "--probe-timeout",
        "0.2",
        "--tries",
        "1",
    )
    # Nothing listens on port 9: reported server by server, not a traceback.
    assert unreachable.returncode == 1 and "Traceback" not in unreachable.stderr
    assert "http://127.0.0.1:9 [http://127.0.0.1:9] status: unreachable" in unreachable.stderr
    assert cli("prepare", "x", "--deadline", "-1").returncode == 2
