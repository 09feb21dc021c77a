"""The server runtime and the controller side are separate programs sharing one small vocabulary.

Each check runs in a fresh interpreter (nothing imported yet by the test session) and lists
the plugin's modules loaded after importing one side and exercising its factory.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PACKAGE = "nemo_gym_checkpoint_plugin"
# Modules of the server runtime, by prefix.
RUNTIME = tuple(
    f"{PACKAGE}.{name}"
    for name in (
        "_control",
        "_workers",
        "_gate",
        "_explicit_ids",
        "_seeds",
        "_routes",
        "_admission",
        "_attach",
        "mixin",
        "wrap",
        "_client",
        "_ray_off",
        "builtin_participants",
        "_storage.writer",
        "_storage.local",
        "_storage.executor",
        "_storage.objstore_writer",
        "_storage.objstore_backend",
    )
)
# Modules of the controller side.
CONTROLLER = tuple(f"{PACKAGE}.{name}" for name in ("coordination", "cli"))
TESTING = (f"{PACKAGE}.testing",)


def _loaded_after(code: str) -> list[str]:
    probe = code + f"\nimport sys, json\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith({PACKAGE!r}))))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _of(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes)]


def test_the_server_runtime_loads_no_controller_module() -> None:
    loaded = _loaded_after(
        "import nemo_gym_checkpoint_plugin._attach, nemo_gym_checkpoint_plugin.mixin, nemo_gym_checkpoint_plugin.wrap\n"
        "import nemo_gym_checkpoint_plugin._routes, nemo_gym_checkpoint_plugin._gate\n"
        "import nemo_gym_checkpoint_plugin._client\n"
        "import nemo_gym_checkpoint_plugin.builtin_participants.environment.steps\n"
        "import nemo_gym_checkpoint_plugin.builtin_participants.agent.open_sessions\n"
        "import nemo_gym_checkpoint_plugin.builtin_participants.resources.session_bindings\n"
        "from nemo_gym_checkpoint_plugin._plugins import make_plugin_manager, get_storage_backend\n"
        "from nemo_gym_checkpoint_plugin._control import ControlPlane\n"
        "pm = make_plugin_manager()\n"
        "ControlPlane(pm, kind='model', instance='m')\n"
    )
    assert _of(loaded, RUNTIME), "the probe did not load the runtime at all"
    assert _of(loaded, CONTROLLER) == []
    assert _of(loaded, TESTING) == []


def test_the_controller_side_loads_no_server_runtime_module() -> None:
    loaded = _loaded_after(
        "import nemo_gym_checkpoint_plugin.coordination, nemo_gym_checkpoint_plugin.cli\n"
        "import nemo_gym_checkpoint_plugin.cli._offline, nemo_gym_checkpoint_plugin.cli._live\n"
        # The checkpointed collector: Gym's rollout collection composed, still no server runtime.
        "import nemo_gym_checkpoint_plugin.cli._collect, nemo_gym_checkpoint_plugin.coordination._collection\n"
        "import nemo_gym_checkpoint_plugin.coordination._checkpointer\n"
        "from nemo_gym_checkpoint_plugin.coordination._order import order_manager\n"
        "order_manager().hook.coordination_order(operation='prepare')\n"
        "from nemo_gym_checkpoint_plugin.cli import build_parser\n"
        "build_parser()\n"
    )
    assert _of(loaded, CONTROLLER), "the probe did not load the controller at all"
    assert _of(loaded, RUNTIME) == []
    assert _of(loaded, TESTING) == []


@pytest.mark.parametrize("module", [f"{PACKAGE}.api", f"{PACKAGE}.hookspecs"])
def test_the_plugin_authors_modules_load_neither_side(module: str) -> None:
    loaded = _loaded_after(f"import {module}")
    assert _of(loaded, RUNTIME) == [] and _of(loaded, CONTROLLER) == []


# The public surface, by name: every other module of the package starts with "_" (docs/plugins.md).
PUBLIC_TOP = {"api", "cli", "coordination", "mixin", "wrap", "testing", "hookspecs", "builtin_participants"}


def test_every_module_outside_the_documented_public_ones_is_private_by_name() -> None:
    import pkgutil

    import nemo_gym_checkpoint_plugin
    from nemo_gym_checkpoint_plugin import cli, coordination

    top = {info.name for info in pkgutil.iter_modules(nemo_gym_checkpoint_plugin.__path__)}
    assert {"api", "coordination", "_control", "_storage"} <= top
    assert sorted(name for name in top if not name.startswith("_") and name not in PUBLIC_TOP) == []
    for package in (coordination, cli):
        inner = {info.name for info in pkgutil.iter_modules(package.__path__)}
        assert inner, package.__name__
        assert sorted(name for name in inner if not name.startswith("_")) == [], package.__name__
