"""``ng-checkpoint`` as an operator meets it, against real participant servers (uvicorn processes).

Most commands run in-process (``main``, as the console script calls it) to keep the test
short; the commands the CLI suggests are pasted into a real shell, as a user would.
"""

from __future__ import annotations

import os
import pty
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import orjson
import pytest
import yaml
from coord_support import FOUR, TOKEN, config_for, four_participants, start_participants, stop_participants

from nemo_gym_checkpoint_plugin.cli import main

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
OWN_VARS = ("NG_CHECKPOINT_TOKEN", "NG_CHECKPOINT_CONFIG", "CLI_CFG_TOKEN", "COLUMNS")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in OWN_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def four(tmp_path):
    servers = four_participants(tmp_path)
    yield servers
    stop_participants(servers)


def urls(servers) -> list[str]:
    return [arg for s in servers for arg in ("--url", s.url)]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    assert TOKEN not in captured.out + captured.err  # the token is never printed
    return code, captured.out, captured.err


def paste(line: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run a command line the CLI suggested, as a user pasting it into a shell would."""
    assert line.startswith("ng-checkpoint ")
    env = {**env, "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}"}
    return subprocess.run(["/bin/sh", "-c", line], capture_output=True, text=True, timeout=120, env=env)


def suggested(text: str, command: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith(f"ng-checkpoint {command} ")]
    assert len(lines) == 1, text
    return lines[0]


def test_default_token_and_deployment_then_restore_all_and_paste_resume(four, tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("NG_CHECKPOINT_TOKEN", TOKEN)

    # NG_CHECKPOINT_TOKEN with --url; the table fits an 80-column terminal (stdout is not one).
    code, out, err = run(capsys, "status", *urls(four))
    assert code == 0, err
    assert out.splitlines()[0].split() == ["NAME", "KIND", "PHASE", "CHECKPOINT", "LEASE", "NOTES"]
    assert max(map(len, out.splitlines())) <= 80
    assert re.search(r"^agent +agent +idle +- +- +1 restart$", out, re.M), out

    # A default deployment: the config NG_CHECKPOINT_CONFIG names (its own token variable unset, so
    # NG_CHECKPOINT_TOKEN gives the token).
    config = tmp_path / "gym.yaml"
    config.write_text(yaml.safe_dump(config_for(four, token_env="CLI_CFG_TOKEN")))
    monkeypatch.setenv("NG_CHECKPOINT_CONFIG", str(config))
    code, out, err = run(capsys, "prepare", "step-1", "--deadline", "20")
    assert code == 0, err
    assert "restarts (leave them out of the commit scope): r3\n" in out
    assert "[4/4] prepare" in err
    code, out, err = run(capsys, "commit", "step-1", "--dir", str(ckpt), "--all")
    assert code == 0, err
    # --all leaves out r3, the agent's restart, everywhere (not only where it was reported).
    assert out == (
        f"committed step-1 to {ckpt}: episodes written: agent 2, env 2, policy_model 2, tools 2\n"
        "left out 1 restart(s) (they start over after a crash): r3\n"
    )
    assert run(capsys, "resume", "step-1")[0] == 0

    # A restore scope the checkpoint does not hold: refused before any server is called.
    code, out, err = run(capsys, "restore", "restore-0", "--dir", str(ckpt), "--episode", "r7")
    assert code == 2 and "does not hold r7" in err
    assert all("restore" not in server.ops() for server in four)

    # restore --all: every episode the checkpoint holds (the union over participants).
    env = {k: v for k, v in os.environ.items() if k not in OWN_VARS}
    env.update(NG_CHECKPOINT_TOKEN=TOKEN, NG_CHECKPOINT_CONFIG=str(config))
    restored = paste(f"ng-checkpoint restore restore-1 --dir {ckpt} --all", env)
    assert restored.returncode == 0, restored.stderr
    assert "restored step-1 as restore-1: r1-a1, r2-a2;" in restored.stdout
    # It says how to continue them: each resent as the attempt it names (N+1), never as N.
    assert "send each restored rollout's row again as the attempt named above, its attempt N+1" in restored.stdout
    # The suggested resume works as printed: the deployment comes from NG_CHECKPOINT_CONFIG.
    resume = suggested(restored.stdout, "resume")
    assert resume == "ng-checkpoint resume restore-1"
    resumed = paste(resume, env)
    assert resumed.returncode == 0 and "resumed restore-1 on 4 participant(s)" in resumed.stdout

    # status --watch, bounded: two refreshes, each a full table that fits 80 columns.
    code, out, err = run(capsys, "status", "--watch", "0.1", "--count", "2")
    assert code == 0, err
    assert len(re.findall(r"^-- \d\d:\d\d:\d\d \(every 0.1s, Ctrl-C stops\)$", out, re.M)) == 2
    assert out.count("NAME  ") == 2 and max(map(len, out.splitlines())) <= 80
    code, out, err = run(capsys, "status", "--watch", "0.1", "--count", "2", "--json")
    assert code == 0 and [len(orjson.loads(line)["participants"]) for line in out.splitlines()] == [4, 4]


def test_wrong_token_is_one_message_naming_its_source(four, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NG_CHECKPOINT_TOKEN", "not-the-token-0123456789")
    code, out, err = run(capsys, "status", *urls(four))
    assert code == 1 and out == ""
    assert err == (
        "error: the control token was refused (HTTP 401 unauthorized) by every server (4): it was "
        "read from the variable NG_CHECKPOINT_TOKEN, and it is not the token the servers were "
        "started with\n"
    )
    token_file = tmp_path / "token"
    token_file.write_text("also-wrong-0123456789\n")
    code, out, err = run(capsys, "prepare", "step-1", *urls(four), "--token-file", str(token_file))
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and f"read from --token-file {token_file}," in err
    assert "no_model_participant" not in err and "discover failed" not in err
    code, out, err = run(capsys, "--json", "status", *urls(four), "--token-file", str(token_file))
    failures = orjson.loads(out)["failures"]
    assert code == 1 and err == "" and [f["code"] for f in failures] == ["unauthorized"] * 4  # no follow-on


def test_failed_commit_says_what_to_do_and_its_commands_work(tmp_path, capsys, monkeypatch):
    specs = [dict(FOUR[0], holds=["r1"]), dict(FOUR[1], holds=["r1"], export_error="export_failed")]
    servers = start_participants(tmp_path, specs)
    try:
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN)
        where = [*urls(servers), "--token-file", str(token_file)]
        assert run(capsys, "prepare", "step-1", *where)[0] == 0
        code, out, err = run(capsys, "commit", "step-1", *where, "--dir", str(tmp_path / "ckpt"), "--all")
        assert code == 1 and out == ""
        failure = f"policy_model [{servers[1].url}] commit: export_failed (HTTP "
        assert err.count(failure) == 1  # once: the progress line says only the code
        assert "FAILED export_failed" in err
        assert "Resume step-1 to reopen it, then prepare again under a new id" in err
        env = {k: v for k, v in os.environ.items() if k not in OWN_VARS}
        resumed = paste(suggested(err, "resume"), env)
        assert resumed.returncode == 0, resumed.stderr
        prepared = paste(suggested(err, "prepare"), env)
        assert prepared.returncode == 0 and "prepared step-1-retry: ready" in prepared.stdout
        assert suggested(err, "commit").startswith(f"ng-checkpoint commit step-1-retry --dir {tmp_path}/ckpt-retry")
        assert run(capsys, "resume", "step-1-retry", *where)[0] == 0
    finally:
        stop_participants(servers)


def test_progress_while_waiting_goes_to_stderr_never_into_json(tmp_path, capsys, monkeypatch):
    specs = [dict(FOUR[0]), dict(FOUR[1], blockers=["r5"])]
    servers = start_participants(tmp_path, specs)
    monkeypatch.setenv("NG_CHECKPOINT_TOKEN", TOKEN)
    try:
        code, out, err = run(capsys, "prepare", "p-1", *urls(servers), "--deadline", "2", "--progress-every", "0.2")
        assert code == 3
        assert "... prepare p-1: waiting for policy_model (" in err and "deadline in" in err
        assert "waiting for" not in out
        assert run(capsys, "resume", "p-1", *urls(servers))[0] == 0
        code, out, err = run(
            capsys, "prepare", "p-2", *urls(servers), "--deadline", "1", "--progress-every", "0.2", "--json"
        )
        assert code == 3 and err == "" and orjson.loads(out)["blockers"] == ["r5"]
        assert run(capsys, "resume", "p-2", *urls(servers))[0] == 0
    finally:
        stop_participants(servers)


def run_with_terminal_stderr(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal (as in a shell) and stdout on a pipe."""
    master, slave = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "nemo_gym_checkpoint_plugin.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=slave,
        env=env,
        text=True,
    )
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO once the process closed its end
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        out, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
        reader.join(timeout=30)
        os.close(master)
    return process.returncode, out, b"".join(chunks).decode("utf-8", "replace")


def test_live_progress_line_on_a_terminal_and_a_clean_stdout(tmp_path):
    servers = start_participants(tmp_path, [dict(FOUR[0]), dict(FOUR[1], blockers=["r5"])])
    env = {k: v for k, v in os.environ.items() if k not in OWN_VARS}
    env.update(NG_CHECKPOINT_TOKEN=TOKEN, COLUMNS="80")
    try:
        code, out, err = run_with_terminal_stderr(["prepare", "t-1", *urls(servers), "--deadline", "2"], env)
        assert code == 3
        assert "prepare t-1: waiting for policy_model (" in err  # the live line, on the terminal
        # stdout (a pipe) holds only the summary: no escape codes, the suggested command on one line.
        assert "\x1b" not in out and "waiting" not in out
        assert suggested(out, "resume") == f"ng-checkpoint resume t-1 --url {servers[0].url} --url {servers[1].url}"
        assert paste(suggested(out, "resume"), env).returncode == 0
    finally:
        stop_participants(servers)


def test_watch_stops_on_ctrl_c(tmp_path):
    servers = start_participants(tmp_path, [dict(FOUR[1])])
    env = {k: v for k, v in os.environ.items() if k not in OWN_VARS}
    env["NG_CHECKPOINT_TOKEN"] = TOKEN
    watch = subprocess.Popen(
        [sys.executable, "-m", "nemo_gym_checkpoint_plugin.cli", "status", *urls(servers), "--watch", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    watchdog = threading.Timer(120, watch.kill)  # bounds the blocking readline below
    watchdog.start()
    try:
        assert watch.stdout.readline().startswith("-- ")  # the first refresh is out
        watch.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=60)
        assert watch.returncode == 0 and "Traceback" not in err
    finally:
        watchdog.cancel()
        if watch.poll() is None:
            watch.kill()
        stop_participants(servers)
