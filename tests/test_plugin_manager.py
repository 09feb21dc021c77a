"""The plugin manager factory, and the core and seed hooks the control plane does not drive itself."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import pluggy
import pytest
from control_support import Harness, Participant, close_harness, make_harness, wire

from nemo_gym_checkpoint_plugin._control import Participants, SeedDeclaration
from nemo_gym_checkpoint_plugin._control.lease import DefaultLeasePolicy
from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._markers import PROJECT, hookimpl
from nemo_gym_checkpoint_plugin._plugins import PluginLoadError, builtin_plugins, make_plugin_manager
from nemo_gym_checkpoint_plugin._storage import LocalStorage, LocalStoragePlugin
from nemo_gym_checkpoint_plugin.coordination._order import DefaultCoordinationOrder, order_manager


def _entry_points(*points: tuple[str, str]) -> Any:
    def fake(*, group: str) -> list[importlib.metadata.EntryPoint]:
        assert group == PROJECT
        return [importlib.metadata.EntryPoint(name=name, value=value, group=group) for name, value in points]

    return fake


def test_builtins_are_an_explicit_tuple_of_core_defaults() -> None:
    kinds = [type(p) for p in builtin_plugins()]
    # A server's core defaults; the coordination order is the controller side's (order_manager).
    assert kinds == [LocalStoragePlugin, DefaultLeasePolicy]
    pm = make_plugin_manager(load_entry_points=False)
    assert make_plugin_manager(load_entry_points=False) is not pm  # no module-global manager
    assert not pm.hook.coordination_order.get_hookimpls()
    controller = order_manager(load_entry_points=False)
    assert [type(p) for p in controller.get_plugins()] == [DefaultCoordinationOrder]
    for manager, hook in ((pm, "storage_backend"), (pm, "lease_policy"), (controller, "coordination_order")):
        # Core defaults answer last, so any user plugin answering first replaces them.
        assert all(impl.trylast for impl in getattr(manager.hook, hook).get_hookimpls())


def test_entry_point_plugins_are_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "entry_points", _entry_points(("verifier", "control_entry_point")))
    pm = make_plugin_manager()
    assert pm.get_plugin("verifier") is not None
    assert pm.hook.status_fields() == [{"from_entry_point": True}]


def test_a_plugin_that_fails_to_import_stops_startup_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "entry_points", _entry_points(("broken_verifier", "no_such_module_x")))
    with pytest.raises(PluginLoadError, match="broken_verifier") as info:
        make_plugin_manager()
    assert info.value.plugin_name == "broken_verifier"


def test_an_implementation_matching_no_spec_is_refused() -> None:
    class Misspelt:
        @hookimpl
        def exprot(self, checkpoint_id: str) -> None: ...

    with pytest.raises(pluggy.PluginValidationError, match="exprot"):
        make_plugin_manager([Misspelt()], load_entry_points=False)


def test_an_implementation_with_unknown_arguments_is_refused() -> None:
    class WrongArgs:
        @hookimpl
        def retire(self, episode_ids: list[EpisodeId], reason: str) -> None: ...

    with pytest.raises(pluggy.PluginValidationError, match="reason"):
        make_plugin_manager([WrongArgs()], load_entry_points=False)


def test_hook_coordination_order_default_and_replacement() -> None:
    pm = order_manager(load_entry_points=False)
    assert pm.hook.coordination_order(operation="prepare") == [["environment"], ["model"], ["agent"], ["resources"]]
    assert pm.hook.coordination_order(operation="resume") == [["resources"], ["agent"], ["model"], ["environment"]]
    assert pm.hook.coordination_order(operation="retire") == [["environment"], ["agent"], ["model", "resources"]]

    class AllAtOnce:
        @hookimpl
        def coordination_order(self, operation: str) -> list[list[str]] | None:
            return [["environment", "model", "agent", "resources"]] if operation == "forget" else None

    pm = order_manager([AllAtOnce()], load_entry_points=False)
    assert pm.hook.coordination_order(operation="forget") == [["environment", "model", "agent", "resources"]]
    assert pm.hook.coordination_order(operation="commit") == [["environment", "model", "agent", "resources"]]
    assert pm.hook.coordination_order(operation="retire") == [["environment"], ["agent"], ["model", "resources"]]


class RecordingStorage(LocalStorage):
    def __init__(self) -> None:
        self.opened: list[str] = []

    def open_writer(self, checkpoint_dir: Any, kind: str, instance: str, checkpoint_id: str) -> Any:
        self.opened.append(checkpoint_id)
        return super().open_writer(checkpoint_dir, kind, instance, checkpoint_id)


class RecordingStoragePlugin:
    def __init__(self) -> None:
        self.backend = RecordingStorage()

    @hookimpl
    def storage_backend(self, name: str) -> LocalStorage | None:
        return self.backend if name == "local" else None


async def test_hook_storage_backend_chosen_by_the_control_plane(tmp_path: Path) -> None:
    plugin = RecordingStoragePlugin()
    h: Harness = await make_harness(tmp_path, extra_plugins=(plugin,))
    try:
        h.participant.add("r1")
        await h.checkpoint("c1", ["r1"])
        assert plugin.backend.opened == ["c1"]
        assert "storage_backend" in h.recorder.names
    finally:
        await close_harness(h)


class Replayable:
    @hookimpl
    async def seed_session(self, episode_id: EpisodeId, session: dict[str, Any]) -> SeedDeclaration:
        return SeedDeclaration(verify_replay=True)


async def test_hook_seed_session_declarations_become_reply_headers() -> None:
    participant = Participant(seed=SeedDeclaration(verify_replay=True))
    facade = Participants(make_plugin_manager([participant, Replayable()], load_entry_points=False))
    episode = EpisodeId(rollout_id="r1", attempt=2)
    assert await facade.seed_session(episode, {"seed": 7}) == {"x-ng-checkpoint-verify": "replay"}
    assert participant.called("seed_session") == [{"episode_id": "r1-a2", "session": {"seed": 7}}]
    # One plugin that may not replay wins over one that may; any restart makes the episode a restart.
    participant.seed = SeedDeclaration(restart=True)
    assert await facade.seed_session(episode, {}) == {"x-ng-checkpoint-restart": "1"}
    participant.seed = None
    assert await facade.seed_session(episode, {}) == {"x-ng-checkpoint-verify": "replay"}
    lone = Participants(make_plugin_manager([Participant()], load_entry_points=False))
    assert await lone.seed_session(episode, {}) == {}


def test_wire_helper_round_trips_capture_keys() -> None:
    assert wire("r-a3") == {"rollout_id": "r", "attempt": 3} and wire("r") == {"rollout_id": "r", "attempt": 0}
