"""Every hookspec has a test that calls it, and a docstring that is a contract.

Convention (as datasette's ``test_plugins.py``): a test named ``test_hook_<...>`` names
every hook it exercises, and its body refers to that hook (a recorded call, the facade,
or ``pm.hook.<name>``). Those tests assert the call happened through pluggy's hook-call
monitoring (``control_support.HookRecorder``) or the in-test participant's call log.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from nemo_gym_checkpoint_plugin.hookspecs import SPEC_MODULES

from nemo_gym_checkpoint_plugin._markers import PROJECT

TESTS = Path(__file__).parent
SPEC_MARK = f"{PROJECT}_spec"


def _hookspecs() -> dict[str, object]:
    specs = {}
    for module in SPEC_MODULES:
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if hasattr(function, SPEC_MARK):
                specs[name] = function
    return specs


def _hook_tests() -> dict[str, str]:
    """``test_hook_*`` function names -> their source, across the test files."""
    found: dict[str, str] = {}
    for path in sorted(TESTS.glob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_hook_"):
                found[f"{path.name}::{node.name}"] = ast.get_source_segment(source, node) or ""
    return found


HOOKSPECS = _hookspecs()
HOOK_TESTS = _hook_tests()


def test_the_spec_modules_hold_the_hooks_of_the_design() -> None:
    participant = {
        "export",
        "install",
        "retire",
        "delete_restored",
        "seed_session",
        "ready",
        "wait_ready",
        "close_admission",
        "preparing",
        "open_admission",
        "restored_pending",
        "release_exported",
        "forgotten",
        "status_fields",
        "attach",
        "serving",
    }
    core = {"storage_backend", "lease_policy", "coordination_order"}
    assert set(HOOKSPECS) == participant | core


@pytest.mark.parametrize("hook", sorted(HOOKSPECS))
def test_every_hookspec_has_a_test_that_calls_it(hook: str) -> None:
    named = {test: source for test, source in HOOK_TESTS.items() if hook in test.split("::")[1]}
    assert named, f"no test_hook_* test names the hook {hook!r}"
    body_refers = [test for test, source in named.items() if hook in source.split(":", 1)[1].split("\n", 1)[1]]
    assert body_refers, f"tests naming {hook!r} never refer to it in their body: {sorted(named)}"


@pytest.mark.parametrize("hook", sorted(HOOKSPECS))
def test_every_hookspec_docstring_is_a_contract(hook: str) -> None:
    doc = inspect.getdoc(HOOKSPECS[hook]) or ""
    assert "Called" in doc, f"{hook}: say when it is called"
    assert "Rais" in doc, f"{hook}: say what raising means"
    opts = getattr(HOOKSPECS[hook], SPEC_MARK)
    if opts.get("firstresult"):
        assert "firstresult" in doc, f"{hook}: say that the first answer wins"
