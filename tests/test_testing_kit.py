"""The testing kit ships in the wheel and stays out of the product.

- The kit needs nothing beyond the plugin's runtime dependencies and pytest (no httpx).
- No product module imports ``nemo_gym_checkpoint_plugin.testing``: checked in the source
  (every import statement, lazy ones inside functions included) and in a fresh interpreter
  that imports every product module.
- The wheel, installed non-editable into a fresh virtual environment that sees the
  nemo-gym installation, runs from outside the source tree: the package, ``ng-checkpoint
  --help``, the demo's and serve's ``--help``, and the fake backend from the installed package.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

from nemo_gym_checkpoint_plugin.testing.harness import free_port_base

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nemo_gym_checkpoint_plugin"
KIT = PACKAGE / "testing"
# Installed as subpackages of nemo_gym_checkpoint_plugin (pyproject's package-dir).
MAPPED = {"hookspecs": ROOT / "hookspecs", "builtin_participants": ROOT / "builtin_participants"}


def _product_files() -> list[Path]:
    files = [p for p in PACKAGE.rglob("*.py") if KIT not in p.parents]
    for source in MAPPED.values():
        files.extend(source.rglob("*.py"))
    return sorted(files)


def _imports_the_kit(path: Path) -> list[str]:
    """The import statements of ``path`` that name the testing kit, as ``line: statement``."""
    # The module's package, to resolve relative imports (``from ..testing import x``).
    if path.is_relative_to(PACKAGE):
        parts = ["nemo_gym_checkpoint_plugin", *path.relative_to(PACKAGE).parent.parts]
    else:
        source = next(name for name, where in MAPPED.items() if path.is_relative_to(where))
        parts = ["nemo_gym_checkpoint_plugin", source, *path.relative_to(MAPPED[source]).parent.parts]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        else:
            continue
        if any(
            name == "nemo_gym_checkpoint_plugin.testing" or name.startswith("nemo_gym_checkpoint_plugin.testing.")
            for name in names
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_product_module_imports_the_testing_kit() -> None:
    files = _product_files()
    assert PACKAGE / "_gate.py" in files and ROOT / "builtin_participants" / "__init__.py" in files
    assert [hit for path in files for hit in _imports_the_kit(path)] == []


_IMPORT_EVERY_PRODUCT_MODULE = r"""
import importlib, json, pkgutil, sys
names = []

def walk(package):
    # Not pkgutil.walk_packages: it imports every package it meets, the kit's included.
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        # __main__ modules run a program when imported; the kit is what is being checked for.
        if info.name.endswith(".__main__") or info.name == "nemo_gym_checkpoint_plugin.testing":
            continue
        names.append(info.name)
        module = importlib.import_module(info.name)
        if info.ispkg:
            walk(module)

walk(importlib.import_module("nemo_gym_checkpoint_plugin"))
for mapped in ("nemo_gym_checkpoint_plugin.hookspecs", "nemo_gym_checkpoint_plugin.builtin_participants"):
    if mapped not in names:  # an editable install maps these outside the package directory
        names.append(mapped)
        walk(importlib.import_module(mapped))
kit = sorted(m for m in sys.modules if m.startswith("nemo_gym_checkpoint_plugin.testing"))
print(json.dumps({"imported": names, "kit": kit}))
"""


@pytest.mark.slow
def test_importing_every_product_module_loads_no_testing_module(tmp_path: Path) -> None:
    reply = subprocess.run(
        [sys.executable, "-c", _IMPORT_EVERY_PRODUCT_MODULE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    assert reply.returncode == 0, reply.stderr[-3000:]
    loaded = json.loads(reply.stdout.strip().splitlines()[-1])
    expected = {"_gate", "cli._live", "_control", "_storage", "coordination", "hookspecs", "builtin_participants"}
    assert {f"nemo_gym_checkpoint_plugin.{name}" for name in expected} <= set(loaded["imported"])
    assert loaded["kit"] == []


_IMPORT_THE_KIT_WITHOUT_HTTPX = r"""
import importlib, pkgutil, sys
# httpx is only in the test extra: None in sys.modules makes any import of it fail.
sys.modules["httpx"] = None
import nemo_gym_checkpoint_plugin.testing as kit
names = [info.name for info in pkgutil.iter_modules(kit.__path__, kit.__name__ + ".")]
for name in names:
    importlib.import_module(name)
print(" ".join(sorted(names)))
"""


@pytest.mark.slow
def test_the_kit_imports_without_httpx(tmp_path: Path) -> None:
    reply = subprocess.run(
        [sys.executable, "-c", _IMPORT_THE_KIT_WITHOUT_HTTPX], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert reply.returncode == 0, reply.stderr[-3000:]
    modules = reply.stdout.split()
    for name in ("crash_scenario", "demo", "serve", "harness", "pytest_plugin", "deployment", "fake_backend"):
        assert f"nemo_gym_checkpoint_plugin.testing.{name}" in modules


# -- the wheel, installed non-editable into a fresh venv ----------------------------------------------------

_PROBE = r"""
import json, sys
import nemo_gym, nemo_gym_checkpoint_plugin
import nemo_gym_checkpoint_plugin.builtin_participants, nemo_gym_checkpoint_plugin.hookspecs
import nemo_gym_checkpoint_plugin._errors, nemo_gym_checkpoint_plugin._markers
import nemo_gym_checkpoint_plugin.testing.pytest_plugin
from nemo_gym_checkpoint_plugin.testing.deployment import fake_backend_script
from nemo_gym_checkpoint_plugin import api
print(json.dumps({
    "api": api.__file__,
    "api_names": sorted(name for name in api.__all__ if getattr(api, name, None) is not None),
    "package": nemo_gym_checkpoint_plugin.__file__,
    "hookspecs": nemo_gym_checkpoint_plugin.hookspecs.__file__,
    "builtin_participants": nemo_gym_checkpoint_plugin.builtin_participants.__file__,
    "fake_backend": str(fake_backend_script()),
    "nemo_gym": nemo_gym.__file__,
    "editable_finders": [m for m in sys.modules if m.startswith("__editable__")],
}))
"""


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    reply = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert reply.returncode == 0, f"{argv}: status {reply.returncode}\n{reply.stdout[-2000:]}\n{reply.stderr[-3000:]}"
    return reply


def _build_wheel(tmp_path: Path, env: dict[str, str]) -> Path:
    # Built from a copy, so the build's egg-info and build/ never land in the source tree.
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("nemo_gym_checkpoint_plugin", "hookspecs", "builtin_participants"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    out = tmp_path / "dist"
    # Build isolation fetches setuptools (the build backend) from the package index.
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(out),
            str(source),
        ],
        tmp_path,
        env,
        timeout=300,
    )
    (wheel,) = out.glob("nemo_gym_checkpoint-*.whl")
    return wheel


def _fresh_venv(tmp_path: Path, env: dict[str, str]) -> tuple[Path, Path]:
    """A venv of .venv's base interpreter whose site-packages sees .venv's by a plain path line."""
    venv = tmp_path / "venv"
    # sys._base_executable: the interpreter .venv was made from (sys.executable is .venv's own).
    _run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    python = venv / "bin" / "python"
    purelib = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path, env
        ).stdout.strip()
    )
    # A plain path line: .venv's site-packages goes on sys.path, but its own .pth files (the
    # editable finder of the source tree among them) are not processed.
    (purelib / "see_dotvenv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv, purelib


@pytest.mark.slow
def test_the_wheel_installed_in_a_fresh_venv_runs_from_outside_the_source_tree(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    wheel = _build_wheel(tmp_path, env)
    venv, purelib = _fresh_venv(tmp_path, env)
    python = venv / "bin" / "python"
    # --ignore-installed: .venv's editable install of the same version is visible; never touch it.
    _run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--ignore-installed",
            "--disable-pip-version-check",
            "-q",
            str(wheel),
        ],
        tmp_path,
        env,
    )
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    probe = json.loads(_run([str(python), "-c", _PROBE], outside, env).stdout.strip().splitlines()[-1])
    installed = purelib / "nemo_gym_checkpoint_plugin"
    assert Path(probe["package"]).parent == installed
    assert Path(probe["hookspecs"]).parent == installed / "hookspecs"
    assert Path(probe["builtin_participants"]).parent == installed / "builtin_participants"
    assert Path(probe["fake_backend"]) == installed / "testing" / "fake_backend.py"
    # The public API a plugin author imports is in the wheel, every name it promises there.
    assert Path(probe["api"]) == installed / "api.py"
    assert {"hookimpl", "EpisodeId", "ParticipantExport", "StorageBackend", "InvalidCheckpointState"} <= set(
        probe["api_names"]
    )
    assert Path(probe["nemo_gym"]).is_relative_to(sysconfig.get_path("purelib"))  # nemo-gym from .venv
    assert probe["editable_finders"] == []
    assert not Path(probe["package"]).is_relative_to(ROOT)

    assert "verify" in _run([str(venv / "bin" / "ng-checkpoint"), "--help"], outside, env).stdout
    assert (
        "--rollouts"
        in _run([str(python), "-m", "nemo_gym_checkpoint_plugin.testing.demo", "--help"], outside, env).stdout
    )
    assert (
        "PORT_BASE"
        in _run([str(python), "-m", "nemo_gym_checkpoint_plugin.testing.serve", "--help"], outside, env).stdout
    )

    # The fake backend runs from the installed package, as the kit's Deployment starts it.
    port = free_port_base(span=1)
    backend = subprocess.Popen(
        [str(python), "-m", "nemo_gym_checkpoint_plugin.testing.fake_backend", "--port", str(port)],
        cwd=outside,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with direct.open(f"http://127.0.0.1:{port}/v1/models", timeout=1) as reply:
                    models = json.load(reply)
                break
            except OSError:
                assert backend.poll() is None, f"the installed fake backend exited with {backend.returncode}"
                assert time.monotonic() < deadline, "the installed fake backend did not serve within 30s"
                time.sleep(0.05)  # wait-ok: interval of a bounded readiness poll
        assert [m["id"] for m in models["data"]] == ["fake-model"]
    finally:
        backend.kill()
        backend.wait(timeout=10)
