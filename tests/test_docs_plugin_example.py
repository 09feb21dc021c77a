"""The worked example of docs/plugins.md runs as written: its budgets survive a commit and a restore."""

from __future__ import annotations

import re
import types
from pathlib import Path

from control_support import close_harness, make_harness, wire

from nemo_gym_checkpoint_plugin._plugins import attach_plugins

DOC = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"


def _example_module() -> types.ModuleType:
    source = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert source is not None, "docs/plugins.md lost its python example"
    module = types.ModuleType("acme_budget_checkpoint")
    exec(compile(source.group(1), str(DOC), "exec"), module.__dict__)  # noqa: S102 - our own doc
    return module


class AcmeBudgetServer:
    def __init__(self) -> None:
        self.budgets: dict[str, int] = {}


async def _participant(tmp_path: Path, server: AcmeBudgetServer) -> tuple[object, object]:
    plugin = _example_module().plugin
    harness = await make_harness(tmp_path, named_plugins={"acme_budget": plugin})
    assert attach_plugins(harness.pm, server=server, app=None, kind="resources", instance="budget", settings=None) == []
    return plugin, harness


async def test_the_documented_plugin_round_trips_its_budgets(tmp_path: Path) -> None:
    before = AcmeBudgetServer()
    before.budgets = {"r1": 3, "r2": 0, "r3": 7}
    _, first = await _participant(tmp_path / "a", before)
    try:
        await first.checkpoint("ck-1", ["r1", "r2"])
    finally:
        await close_harness(first)

    after = AcmeBudgetServer()
    after.budgets = {"r2-a1": 99}  # stale state of a continued episode is cleared by install
    plugin, second = await _participant(tmp_path / "b", after)
    try:
        await second.call(
            "restore", checkpoint_id="re-1", checkpoint_dir=str(first.directory), episode_ids=[wire("r1"), wire("r2")]
        )
    finally:
        await close_harness(second)
    assert after.budgets == {"r1-a1": 3, "r2-a1": 0}
    assert plugin.restored == {"r1-a1", "r2-a1"}


def test_the_documented_plugin_opts_out_of_other_servers() -> None:
    from nemo_gym_checkpoint_plugin._plugins import make_plugin_manager

    plugin = _example_module().plugin
    pm = make_plugin_manager(load_entry_points=False, named_plugins={"acme_budget": plugin})
    assert attach_plugins(pm, server=object(), app=None, kind="model", instance="m", settings=None) == ["acme_budget"]
