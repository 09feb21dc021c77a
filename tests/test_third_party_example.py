"""``examples/third_party_verifier`` installed as a user would, then discovered, checkpointed, crashed and restored.

Hermetic: the package is pip-installed (non-editable, ``--no-deps``, offline with
``--no-build-isolation``) into a fresh venv of its own, which sees the project venv through
a ``.pth`` (``site.addsitedir``, so the project's own editable install resolves too); the
project venv is never changed. From that venv:

1. the package's own tests run (the shipped resources contract suite through the testing
   kit's pytest plugin), against the installed copy;
2. a real deployment (``testing.deployment``: every server wrapped, its children run by the
   venv's Python) runs the package's ``TallyResourcesServer`` from its installed directory as
   the resources server, with ``checkpoint_mode: export_restore`` in its config and nothing
   else naming the plugin: the entry-point group finds it. A rollout's ``/add`` tool call
   runs, its last model call is held, a ``wait``-mode checkpoint takes it inside its agent turn
   (the agent parks at its boundary after the tool call; the held call never blocks),
   every process group is SIGKILLed, fresh processes restore it and it finishes with reward 1:
   the tally came back through the plugin's own records (tagged ``"plugin": "tally_verifier"``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from nemo_gym_checkpoint_plugin.coordination import commit, discover, prepare, restore, resume
from nemo_gym_checkpoint_plugin.testing.deployment import (
    BACKEND,
    ENVIRONMENT,
    RESOURCES,
    Deployment,
    free_port_base,
    rollout_body,
)
from nemo_gym_checkpoint_plugin.testing.gym_config import DEFAULT_CHECKPOINT_BLOCK, TOKEN_ENV, wrapped_entrypoints
from nemo_gym_checkpoint_plugin.testing.harness import FakeBackend

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "third_party_verifier"
TOKEN = "third-party-token"
PLUGIN_NAME = "tally_verifier"
ADD_TOOL = {
    "type": "function",
    "name": "add",
    "description": "",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"amount": {"type": "integer", "description": ""}},
        "required": ["amount"],
        "additionalProperties": False,
    },
}


def _run(argv: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("example-venv")
    venv = root / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], root)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    site = Path(
        _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root).stdout.strip()
    )
    # The project venv behind this one (its .pth files too: the project's editable install).
    (site / "_project_venv.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    installed = _run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            str(EXAMPLE),
        ],
        root,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return venv


def _installed_dir(venv: Path) -> Path:
    found = _run(
        [str(venv / "bin" / "python"), "-c", "import tally_verifier; print(tally_verifier.__file__)"], venv.parent
    )
    assert found.returncode == 0, found.stderr
    return Path(found.stdout.strip()).parent


def test_the_package_is_installed_in_its_own_venv_only(venv: Path) -> None:
    package = _installed_dir(venv)
    assert package.is_relative_to(venv) and (package / "app.py").exists()
    assert (package / "requirements.txt").exists()  # the server directory Gym runs
    # The project venv never sees it.
    here = _run([sys.executable, "-c", "import tally_verifier"], venv.parent)
    assert here.returncode != 0 and "No module named 'tally_verifier'" in here.stderr


def test_the_packages_own_contract_suite_passes_against_the_installed_copy(venv: Path) -> None:
    ran = _run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pytest",
            str(EXAMPLE / "tests"),
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(EXAMPLE),
        ],
        venv.parent,
    )
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-2000:]
    summary = ran.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "failed" not in summary and "skipped" not in summary, summary


def _body(rollout_id: str, attempt: int = 0) -> dict[str, Any]:
    body = rollout_body(rollout_id, attempt=attempt, prompt=f"add one (rollout {rollout_id})")
    task_input = body["task"]["task_input"]
    task_input["responses_create_params"]["tools"] = [ADD_TOOL]
    task_input["task_data"] = {"target": 1}
    return body


async def _post_run(env: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        async with http.post(env + "/run", json=body) as reply:
            reply.raise_for_status()
            return await reply.json()


async def _status(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with http.get(url + "/ng-control/v1/checkpoint/status", headers=headers) as reply:
            reply.raise_for_status()
            return await reply.json()


async def _crash_and_restore(deployment: Deployment, checkpoint_dir: Path) -> dict[str, Any]:
    urls = deployment.urls
    env, fake, rollout = urls[ENVIRONMENT], FakeBackend(urls[BACKEND]), "tally-crashed"
    status_before = await _status(urls[RESOURCES])
    await fake.hold(match=rollout, count=1, step=1)
    first = asyncio.ensure_future(_post_run(env, _body(rollout)))
    await fake.wait_for(lambda s: s["held"] >= 1, 60, "the rollout's answer after its tool call held")
    coordinator = await discover(deployment.config, TOKEN)
    async with coordinator:
        # Mid-turn: the prepare is ready while the model call is still held at the backend.
        prepared = await prepare(coordinator, "ck-tally", timeout=60)
        assert prepared.ready, prepared.to_json()
        assert (await fake.stats())["held"] == 1
        committed = await commit(
            coordinator, "ck-tally", str(checkpoint_dir), prepared.continued([rollout]), timeout=60
        )
    pids = {name: proc.pid for name, proc in deployment.processes.items()}
    deployment.kill()
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.to_thread(deployment.start)
    coordinator = await discover(deployment.config, TOKEN)
    async with coordinator:
        restored = await restore(
            coordinator, "rs-tally", str(checkpoint_dir), [{"rollout_id": rollout, "attempt": 0}], timeout=60
        )
        await resume(coordinator, "rs-tally", timeout=60)
    return {
        "status_before": status_before,
        "committed": committed,
        "restored": restored,
        "pids": pids,
        "new_pids": {name: proc.pid for name, proc in deployment.processes.items()},
        "reply": await _post_run(env, _body(rollout, attempt=1)),
        "status_after": await _status(urls[RESOURCES]),
    }


def test_a_real_deployment_discovers_checkpoints_and_restores_the_installed_plugin(venv: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    deployment = Deployment(
        free_port_base(),
        work,
        entrypoints=wrapped_entrypoints(),
        log_dir=work / "logs",
        extra_env={TOKEN_ENV: TOKEN},
        checkpoint={**DEFAULT_CHECKPOINT_BLOCK, "step_mode": "wait"},
        resources={"implementation": "tally", "checkpoint_mode": "export_restore"},
        server_dirs={RESOURCES: _installed_dir(venv)},
        python=str(venv / "bin" / "python"),
    )
    deployment.start()
    try:
        got = asyncio.run(_crash_and_restore(deployment, tmp_path / "ckpt"))
    finally:
        deployment.stop()

    # Discovered from the entry-point group: its status field is in the resources server's status.
    assert got["status_before"]["tally_sessions"] == 0
    assert got["status_before"]["checkpoint_mode"] == "export_restore"
    # Its own record, tagged with its entry-point name, holds the tally after the tool call.
    manifest = got["committed"].replies[RESOURCES]["manifest"]
    records_file = tmp_path / "ckpt" / "gym" / "resources" / RESOURCES / manifest["records_file"]
    [record] = [json.loads(line) for line in records_file.read_text().splitlines()]
    assert record["plugin"] == PLUGIN_NAME
    assert record["episode_id"] == {"rollout_id": "tally-crashed", "attempt": 0}
    assert (record["total"], record["target"]) == (1, 1)
    # The environment's episode is at its seed boundary, its agent turn continues from the agent's record.
    assert got["committed"].replies[ENVIRONMENT]["boundaries"] == {"seeded": 1}
    # SIGKILLed: every server is a new process; restored as the next attempt and finished.
    assert all(got["new_pids"][name] != pid for name, pid in got["pids"].items())
    assert got["restored"].replies[RESOURCES]["restored"] == ["tally-crashed-a1"]
    reply = got["reply"]
    assert reply["failure"] is None, reply["failure"]
    assert reply["episode_id"] == {"rollout_id": "tally-crashed", "attempt": 1}
    assert reply["result"]["reward"] == 1.0  # verify read the restored tally (a lost one reads 0)
