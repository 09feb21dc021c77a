"""Plugin authors can type-check against ``api``: the wheel ships ``py.typed``, and a plugin passes ``mypy --strict``.

The plugin (tests/data/typed_plugin/typed_budget.py) is checked against the built wheel installed in a
fresh venv, not against this source tree: mypy reads an installed package's annotations only when the
package carries ``py.typed`` (PEP 561), which is what a third party's CI sees.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from nemo_gym_checkpoint_plugin import api

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "tests" / "data" / "typed_plugin" / "typed_budget.py"


def _run(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "MYPYPATH")}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # Built from a copy, so the build's egg-info and build/ never land in the source tree; no build
    # isolation: setuptools and wheel are in the test extras, so the build needs no package index.
    source = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("nemo_gym_checkpoint_plugin", "hookspecs", "builtin_participants"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    reply = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(out),
            str(source),
        ],
        out,
    )
    assert reply.returncode == 0, reply.stdout[-2000:] + reply.stderr[-3000:]
    (built,) = out.glob("nemo_gym_checkpoint-*.whl")
    return built


def test_api_version_is_the_installed_distributions() -> None:
    from importlib.metadata import version

    assert api.__version__ == version("nemo-gym-checkpoint")
    assert "__version__" in api.__all__


@pytest.mark.slow
def test_the_wheel_ships_py_typed(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert "nemo_gym_checkpoint_plugin/py.typed" in names
    # The marker covers the mapped packages too: they are installed inside the package directory.
    assert "nemo_gym_checkpoint_plugin/hookspecs/participant.py" in names


@pytest.mark.slow
def test_a_third_party_plugin_written_against_api_passes_mypy_strict(wheel: Path, tmp_path: Path) -> None:
    # A fresh venv holding only the wheel; .venv's site-packages (nemo-gym, pluggy, pydantic...) is seen
    # through a plain path line, so the plugin's own editable finder never stands in for the wheel.
    venv = tmp_path / "venv"
    assert _run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], tmp_path).returncode == 0
    python = venv / "bin" / "python"
    purelib = Path(
        _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path).stdout.strip()
    )
    reply = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "--target",
            str(purelib),
            str(wheel),
        ],
        tmp_path,
    )
    assert reply.returncode == 0, reply.stderr[-3000:]
    (purelib / "see_dotvenv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    mypy = [
        sys.executable,
        "-m",
        "mypy",
        "--strict",
        "--python-executable",
        str(python),
        "--no-incremental",
        "--cache-dir",
        str(tmp_path / "mypy-cache"),
    ]

    reply = _run([*mypy, str(PLUGIN)], tmp_path)
    assert reply.returncode == 0, reply.stdout[-4000:] + reply.stderr[-2000:]

    # The check is real: a plugin that misuses api's types fails it, naming the api type.
    wrong = tmp_path / "wrong_plugin.py"
    wrong.write_text(
        "from __future__ import annotations\n"
        "from nemo_gym_checkpoint_plugin.api import Readiness, hookimpl\n"
        "class P:\n"
        "    @hookimpl\n"
        "    def ready(self, checkpoint_id: str | None) -> Readiness:\n"
        "        return Readiness(blockers=3)\n"
    )
    reply = _run([*mypy, str(wrong)], tmp_path)
    assert reply.returncode == 1 and "Readiness" in reply.stdout, reply.stdout[-4000:]
