"""The set-up script is idempotent and the demo runs end to end."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from nemo_gym_checkpoint_plugin.testing.deployment import free_port_base

ROOT = Path(__file__).resolve().parent.parent


SUMMARY_KEYS = {
    "rollouts",
    "finished",
    "reward_1",
    "continued",
    "restarted",
    "lost",
    "repeated_steps",
    "checkpoint_dir",
    "identical_to_uninterrupted",
    "prepare_s",
    "commit_s",
    "restore_s",
}
DEMO = [sys.executable, "-m", "nemo_gym_checkpoint_plugin.testing.demo"]


def _demo_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    # TMPDIR: the demo's temporary work directory lands under tmp_path, where the test can look for it.
    env = {k: v for k, v in os.environ.items() if k not in ("PORT_BASE", "NG_DEMO_KEEP")}
    return {**env, "TMPDIR": str(tmp_path), **extra}


def _demo_dirs(root: Path) -> list[Path]:
    # Only the demo's own: the Gym servers leave temporary files of their own (wandb's) in TMPDIR too.
    return sorted(root.glob("ng-checkpoint-demo-*"))


def _holding_files_under(root: Path) -> list[int]:
    """Pids of live processes with their cwd or an open file under ``root`` (the demo's servers log there)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            links = [os.readlink(entry / "cwd")] + [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:
            continue
        if any(link.startswith(str(root)) for link in links):
            found.append(int(entry.name))
    return found


def test_setup_second_run_only_checks_its_stamp() -> None:
    # Under `make test` setup has just run, so the first call here is already a no-op; run directly
    # after pyproject.toml changed, the first call brings .venv up to date. The second must not install.
    subprocess.run([str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True, check=True)
    result = subprocess.run([str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True, check=True)
    assert "is up to date" in result.stdout
    assert "installing" not in result.stdout


def test_first_install_says_each_step_and_lets_pip_show_its_progress(tmp_path: Path) -> None:
    # A copy of the repository's set-up inputs, with a stand-in for .venv's python: pip is recorded, not run.
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_bytes((ROOT / "scripts" / "setup.sh").read_bytes())
    (tmp_path / "scripts" / "setup.sh").chmod(0o755)
    (tmp_path / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1 $2" = "-m pip" ]; then echo "pip args: $*"; echo "Collecting nemo-gym==0.7.0"; exit 0; fi\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    python.chmod(0o755)
    env = {**os.environ, "NG_PYTHON": sys.executable}

    first = subprocess.run(
        [str(tmp_path / "scripts" / "setup.sh")], env=env, capture_output=True, text=True, check=True, timeout=60
    )

    steps = [line for line in first.stdout.splitlines() if line.startswith("setup: [")]
    assert [step.split("]")[0] for step in steps] == ["setup: [1/3", "setup: [2/3", "setup: [3/3"]
    (pip_args,) = [line for line in first.stdout.splitlines() if line.startswith("pip args: ")]
    assert "--quiet" not in pip_args.split() and "-q" not in pip_args.split()
    assert "Collecting nemo-gym==0.7.0" in first.stdout  # pip's own lines reach the user
    second = subprocess.run(
        [str(tmp_path / "scripts" / "setup.sh")], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    assert second.stdout == "setup: .venv is up to date\n"


@pytest.mark.slow
def test_demo_checkpoints_crashes_restores_and_finishes(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nemo_gym_checkpoint_plugin.testing.demo", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    summary = orjson.loads(result.stdout.strip().splitlines()[-1])
    assert set(summary) == SUMMARY_KEYS
    assert summary["rollouts"] == 64
    assert summary["finished"] == summary["rollouts"] == summary["reward_1"]
    assert summary["lost"] == 0 and summary["repeated_steps"] == 0
    assert summary["identical_to_uninterrupted"] is True
    assert summary["continued"] > 0
    assert summary["prepare_s"] > 0 and summary["commit_s"] > 0 and summary["restore_s"] > 0
    assert summary["checkpoint_dir"] == str(tmp_path / "ckpt")
    assert list((tmp_path / "ckpt").glob("collect-*/collector/manifest.json"))
    assert "SIGKILLed the collector and 5 server process groups" in result.stdout


@pytest.mark.slow
def test_demo_honours_port_base_and_removes_its_temporary_directory(tmp_path: Path) -> None:
    port_base = free_port_base()
    result = subprocess.run(
        [*DEMO, "--rollouts", "2"],
        env=_demo_env(tmp_path, PORT_BASE=str(port_base)),
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    lines = result.stdout.strip().splitlines()
    summary = orjson.loads(lines[-1])
    assert set(summary) == SUMMARY_KEYS
    assert summary["lost"] == 0 and summary["repeated_steps"] == 0
    assert f"on 127.0.0.1:{port_base}-{port_base + 4}:" in result.stdout
    work = Path(summary["checkpoint_dir"]).parent
    assert work.parent == tmp_path and work.name.startswith("ng-checkpoint-demo-")
    assert lines[-2] == f"[demo] removed {work} (--keep or NG_DEMO_KEEP=1 keeps it)"
    assert not work.exists()
    assert _demo_dirs(tmp_path) == []


def _read_until(proc: subprocess.Popen[str], marker: str, timeout: float) -> str:
    """``proc``'s stdout up to and including the first line containing ``marker``."""
    assert proc.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    seen = ""
    try:
        while marker not in seen:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or proc.poll() is not None:
                raise AssertionError(f"no {marker!r} (status {proc.poll()}); got {seen!r}")
            if selector.select(timeout=remaining):
                chunk = os.read(proc.stdout.fileno(), 65536).decode()
                if not chunk:
                    raise AssertionError(f"stdout closed after {seen!r}")
                seen += chunk
    finally:
        selector.close()
    return seen


@pytest.mark.slow
@pytest.mark.parametrize(("marker", "keep"), [("starting the Gym deployment", "1"), ("processes ready", "")])
def test_ctrl_c_stops_the_demo_with_one_line_and_no_server_left(tmp_path: Path, marker: str, keep: str) -> None:
    env = _demo_env(tmp_path, NG_DEMO_KEEP=keep) if keep else _demo_env(tmp_path)
    proc = subprocess.Popen(
        [*DEMO, "--rollouts", "4"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _read_until(proc, marker, timeout=300)
        proc.send_signal(signal.SIGINT)  # the demo alone, as a terminal's Ctrl-C reaches it (servers have own groups)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    assert proc.returncode == 130
    assert "Traceback" not in stderr
    (line,) = stderr.strip().splitlines()
    assert line.startswith("[demo] interrupted: every server stopped; ")
    # The demo stops and reaps every server before it exits: none is left now, not eventually.
    assert _holding_files_under(tmp_path) == []
    if keep:
        (work,) = _demo_dirs(tmp_path)
        assert line.endswith(f"work directory kept: {work}")
    else:
        assert _demo_dirs(tmp_path) == []
