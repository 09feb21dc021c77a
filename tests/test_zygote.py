"""The zygote forks test servers that behave as ``python <argv>`` would, and answers as ``Popen`` does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_gym_checkpoint_plugin.testing.deployment import Deployment
from nemo_gym_checkpoint_plugin.testing.harness import new_deployment, pid_alive, wait_until
from nemo_gym_checkpoint_plugin.testing.zygote import ForkedProcess, Zygote, ZygoteError

pytestmark = pytest.mark.slow

REPORT = textwrap.dedent(
    """
    import atexit, json, os, sys
    out = os.environ["REPORT_TO"]
    report = {
        "name": __name__,
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "path": sys.path[:3],
        "env": dict(os.environ),
        "sid_is_pid": os.getsid(0) == os.getpid(),
        "ppid": os.getppid(),
        "preloaded": "nemo_gym.server_utils" in sys.modules,
    }
    print("to stdout")
    print("to stderr", file=sys.stderr)
    atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
    with open(out, "w") as f:
        json.dump(report, f)
    sys.exit(int(os.environ.get("EXIT_WITH", "0")))
    """
)


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    made = Zygote()
    try:
        yield made
    finally:
        made.close()


def _spawn(zygote: Zygote, tmp_path: Path, argv: list[str], **env: str) -> tuple[ForkedProcess, Path, Path]:
    report = tmp_path / "report.json"
    log = tmp_path / "child.log"
    with open(log, "ab") as out:
        proc = zygote.spawn(
            argv,
            cwd=tmp_path,
            env={"REPORT_TO": str(report), "PYTHONPATH": "/nowhere/one", **env},
            stdout=out.fileno(),
            stderr=out.fileno(),
            start_new_session=True,
        )
    return proc, report, log


def test_a_script_runs_as_main_with_its_own_argv_cwd_environment_path_session_and_log(
    zygote: Zygote, tmp_path: Path
) -> None:
    script_dir = tmp_path / "server"
    script_dir.mkdir()
    (script_dir / "app.py").write_text(REPORT)
    proc, report, log = _spawn(zygote, tmp_path, [sys.executable, str(script_dir / "app.py"), "--flag", "x"])
    assert proc.wait(timeout=60) == 0
    seen = json.loads(report.read_text())
    assert seen["name"] == "__main__"
    assert seen["argv"] == [str(script_dir / "app.py"), "--flag", "x"]
    assert seen["cwd"] == str(tmp_path)
    # As the interpreter builds it: the script's directory, then PYTHONPATH, then the rest.
    assert seen["path"][:2] == [str(script_dir), "/nowhere/one"]
    # Exactly the environment asked for: nothing of the zygote's own (its single-thread settings) leaks in.
    assert seen["env"] == {"REPORT_TO": str(report), "PYTHONPATH": "/nowhere/one"}
    assert seen["sid_is_pid"] is True
    assert seen["ppid"] != os.getpid()  # forked by the zygote, not by this process
    assert seen["preloaded"] is True  # the point: Gym's libraries were imported before the script ran
    assert (tmp_path / "report.json.atexit").read_text() == "ran"  # a normal interpreter exit
    assert log.read_text().splitlines() == ["to stdout", "to stderr"]


def test_a_module_runs_as_dash_m_does(zygote: Zygote, tmp_path: Path) -> None:
    (tmp_path / "reporting_module.py").write_text(REPORT)
    proc, report, _log = _spawn(zygote, tmp_path, [sys.executable, "-m", "reporting_module", "a"])
    assert proc.wait(timeout=60) == 0
    seen = json.loads(report.read_text())
    assert seen["name"] == "__main__"
    assert seen["argv"] == [str(tmp_path / "reporting_module.py"), "a"]
    assert seen["path"][:2] == [str(tmp_path), "/nowhere/one"]


def test_exit_status_and_signals_are_popens(zygote: Zygote, tmp_path: Path) -> None:
    script = tmp_path / "app.py"
    script.write_text(REPORT)
    proc, _report, _log = _spawn(zygote, tmp_path, [sys.executable, str(script)], EXIT_WITH="3")
    assert proc.wait(timeout=60) == 3
    assert proc.returncode == 3 and proc.poll() == 3

    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import signal\nsignal.pause()\n")
    proc, _report, _log = _spawn(zygote, tmp_path, [sys.executable, str(sleeper)])
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert not pid_alive(proc.pid)
    proc.kill()  # a finished process: nothing happens, as with Popen


def test_what_it_cannot_run_is_refused(zygote: Zygote, tmp_path: Path) -> None:
    for argv in (["/usr/bin/python3", "app.py"], [sys.executable, "-c", "pass"], [sys.executable, "-m"]):
        assert not zygote.can_run(argv)
        with pytest.raises(ZygoteError):
            zygote.spawn(argv, cwd=tmp_path, env={}, stdout=1, stderr=2, start_new_session=True)


def test_the_zygote_exits_with_the_process_that_started_it(tmp_path: Path) -> None:
    starter = (
        "import os, sys\n"
        "from nemo_gym_checkpoint_plugin.testing.zygote import Zygote\n"
        "z = Zygote()\n"
        "print(z._proc.pid, flush=True)\n"
        "os._exit(0)\n"  # no cleanup: the zygote must notice on its own
    )
    done = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, timeout=120, check=True)
    zygote_pid = int(done.stdout.split()[0])
    wait_until(lambda: not pid_alive(zygote_pid), 30, "the zygote to exit after its parent")


def test_a_deployment_forked_from_the_zygote_serves_crashes_and_restarts(zygote: Zygote, tmp_path: Path) -> None:
    deployment: Deployment = new_deployment(tmp_path, spawner=zygote)
    try:
        deployment.start()
        assert {type(proc) for proc in deployment.processes.values()} == {ForkedProcess}
        before = {name: proc.pid for name, proc in deployment.processes.items()}
        groups = deployment.process_groups
        assert all(groups[name] == pid for name, pid in before.items())  # each leads its own group
        deployment.kill()
        assert not any(pid_alive(pid) for pid in before.values())
        deployment.start()
        assert not set(before.values()) & {proc.pid for proc in deployment.processes.values()}
    finally:
        deployment.stop()
