"""Records are owned by the plugin that exported them; a plugin learns its server through ``attach``.

A third-party plugin (entry-point group, or registered by name) beside the participant's own
plugin exports its own records for the same episodes: they are written tagged with its name,
and a restore hands each plugin exactly its own records plus the whole scope.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest
from control_support import Participant, close_harness, make_harness, wire

from nemo_gym_checkpoint_plugin._control import ParticipantExport
from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._markers import hookimpl
from nemo_gym_checkpoint_plugin._plugins import PluginLoadError, attach_plugins, make_plugin_manager
from nemo_gym_checkpoint_plugin._storage.layout import participant_dir

VERIFIER = "acme_verifier"


class SidecarVerifier:
    """A third-party plugin keeping its own per-episode notes beside the participant's state."""

    def __init__(self) -> None:
        self.notes: dict[str, dict[str, Any]] = {}
        self.installs: list[dict[str, Any]] = []

    @hookimpl
    def export(self, checkpoint_id: str, scope: frozenset[str] | None) -> ParticipantExport:
        keys = sorted(k for k in self.notes if scope is None or k in scope)
        return ParticipantExport(records=[{"episode_id": wire(k), **self.notes[k]} for k in keys])

    @hookimpl
    def install(
        self, checkpoint_id: str, manifest: Mapping[str, Any], records: list[Any], scope: list[EpisodeId]
    ) -> None:
        self.installs.append(
            {
                "records": [(r.replacement.capture_key, dict(r.record)) for r in records],
                "scope": [e.capture_key for e in scope],
            }
        )


def _records_file(directory: Path) -> list[dict[str, Any]]:
    folder = participant_dir(directory, "environment", "env_one")
    manifest = orjson.loads((folder / "manifest.json").read_bytes())
    return [orjson.loads(line) for line in (folder / manifest["records_file"]).read_bytes().splitlines()]


async def _checkpoint_with_both(tmp_path: Path) -> Path:
    own = Participant()
    own.add("r1", "r2", step=3)
    verifier = SidecarVerifier()
    verifier.notes = {"r1": {"score_so_far": 0.5}, "r2": {"score_so_far": 0.25}}
    harness = await make_harness(tmp_path, own, named_plugins={VERIFIER: verifier})
    try:
        reply = await harness.checkpoint("ck-1", ["r1", "r2"])
    finally:
        await close_harness(harness)
    assert reply["episode_ids"] == ["r1", "r2"]
    return harness.directory


async def test_hook_export_tags_a_third_party_plugins_records_with_its_name(tmp_path: Path) -> None:
    directory = await _checkpoint_with_both(tmp_path)

    records = _records_file(directory)
    own = [r for r in records if "plugin" not in r]
    theirs = [r for r in records if "plugin" in r]
    assert [r["episode_id"]["rollout_id"] for r in own] == ["r1", "r2"]
    assert all(r["step"] == 3 for r in own)
    assert theirs == [
        {"episode_id": wire("r1"), "score_so_far": 0.5, "plugin": VERIFIER},
        {"episode_id": wire("r2"), "score_so_far": 0.25, "plugin": VERIFIER},
    ]


async def test_hook_install_hands_each_plugin_its_own_records_and_the_whole_scope(tmp_path: Path) -> None:
    directory = await _checkpoint_with_both(tmp_path / "first")
    own = Participant()
    verifier = SidecarVerifier()
    harness = await make_harness(tmp_path / "second", own, named_plugins={VERIFIER: verifier})
    try:
        # r9 is continued by the restore but the checkpoint holds no record of it.
        reply = await harness.call(
            "restore",
            checkpoint_id="re-1",
            checkpoint_dir=str(directory),
            episode_ids=[wire("r1"), wire("r2"), wire("r9")],
        )
    finally:
        await close_harness(harness)

    assert reply["restored"] == ["r1-a1", "r2-a1"]
    [own_install] = own.called("install")
    assert [(r.replacement.capture_key, r.record.get("plugin")) for r in own_install["records"]] == [
        ("r1-a1", None),
        ("r2-a1", None),
    ]
    assert verifier.installs == [
        {
            "records": [
                ("r1-a1", {"episode_id": wire("r1"), "score_so_far": 0.5, "plugin": VERIFIER}),
                ("r2-a1", {"episode_id": wire("r2"), "score_so_far": 0.25, "plugin": VERIFIER}),
            ],
            "scope": ["r1-a1", "r2-a1", "r9-a1"],
        }
    ]


async def test_a_record_of_a_plugin_this_server_lacks_fails_the_restore_naming_it(tmp_path: Path) -> None:
    directory = await _checkpoint_with_both(tmp_path / "first")
    own = Participant()
    harness = await make_harness(tmp_path / "second", own)
    try:
        error = await harness.error(
            "restore",
            "invalid_checkpoint_state",
            checkpoint_id="re-1",
            checkpoint_dir=str(directory),
            episode_ids=[wire("r1")],
        )
        status = await harness.status()
    finally:
        await close_harness(harness)
    assert VERIFIER in error["detail"]
    # Refused before anything was retired or installed, and admission reopened.
    assert own.called("install") == [] and own.called("retire") == []
    assert status["phase"] == "idle"


async def test_the_participants_own_records_may_not_claim_an_owner(tmp_path: Path) -> None:
    own = Participant()
    own.episodes["r1"] = {"episode_id": wire("r1"), "plugin": "someone"}
    harness = await make_harness(tmp_path, own)
    try:
        await harness.call("prepare", checkpoint_id="ck-1")
        error = await harness.error(
            "commit",
            "export_failed",
            checkpoint_id="ck-1",
            checkpoint_dir=str(harness.directory),
            episode_ids=[wire("r1")],
        )
    finally:
        await close_harness(harness)
    assert "plugin" in error["detail"]


class Picky:
    """Applies to resources servers only."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    @hookimpl
    def attach(self, server: Any, app: Any, kind: str, instance: str, settings: Any) -> bool:
        self.seen.append({"server": server, "app": app, "kind": kind, "instance": instance, "settings": settings})
        return kind == "resources"

    @hookimpl
    def status_fields(self) -> dict[str, Any]:
        return {"picky": True}


@pytest.mark.parametrize(("kind", "kept"), [("resources", True), ("model", False)])
def test_hook_attach_gives_each_plugin_its_server_and_drops_those_that_do_not_apply(kind: str, kept: bool) -> None:
    picky = Picky()
    pm = make_plugin_manager(load_entry_points=False, named_plugins={"picky": picky})
    server, app, settings = object(), object(), object()

    dropped = attach_plugins(pm, server=server, app=app, kind=kind, instance="inst", settings=settings)

    assert picky.seen == [{"server": server, "app": app, "kind": kind, "instance": "inst", "settings": settings}]
    assert dropped == ([] if kept else ["picky"])
    assert pm.is_registered(picky) is kept
    assert (pm.hook.status_fields() == [{"picky": True}]) is kept
    assert ("picky" in pm.third_party_names) is kept


def test_a_plugin_whose_attach_raises_stops_the_server_naming_it() -> None:
    class Broken:
        @hookimpl
        def attach(self, kind: str) -> None:
            raise RuntimeError("cannot find my database")

    pm = make_plugin_manager(load_entry_points=False, named_plugins={"broken_one": Broken()})
    with pytest.raises(PluginLoadError, match="broken_one.*cannot find my database"):
        attach_plugins(pm, server=None, app=None, kind="model", instance="m", settings=None)


def test_the_public_api_names_what_a_plugin_author_needs_and_the_local_backend_fits_its_protocol() -> None:
    from nemo_gym_checkpoint_plugin import api
    from nemo_gym_checkpoint_plugin._plugins import get_storage_backend

    for name in api.__all__:
        assert getattr(api, name) is not None, name
    assert api.ENTRY_POINT_GROUP == "nemo_gym_checkpoint"
    assert {
        "hookimpl",
        "EpisodeId",
        "ParticipantExport",
        "Readiness",
        "RestoredRecord",
        "SeedDeclaration",
        "InvalidCheckpointState",
        "StorageBackend",
    } <= set(api.__all__)
    backend = get_storage_backend(make_plugin_manager(load_entry_points=False), "local")
    assert isinstance(backend, api.StorageBackend)
    assert isinstance(backend.open_writer("/tmp/unused", "model", "m", "ck"), api.StorageWriter)


async def test_one_record_per_owner_and_episode_is_allowed_two_of_one_owner_are_not(tmp_path: Path) -> None:
    from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState
    from nemo_gym_checkpoint_plugin._storage.reader import read_checkpoint

    directory = await _checkpoint_with_both(tmp_path)
    both = read_checkpoint(directory, "environment", "env_one")
    assert sorted((r["episode_id"]["rollout_id"], r.get("plugin", "")) for r in both.records) == [
        ("r1", ""),
        ("r1", VERIFIER),
        ("r2", ""),
        ("r2", VERIFIER),
    ]

    # The same owner twice for one episode is refused, naming the episode and the owner.
    folder = participant_dir(directory, "environment", "env_one")
    manifest = orjson.loads((folder / "manifest.json").read_bytes())
    lines = (folder / manifest["records_file"]).read_bytes().splitlines(keepends=True)
    tagged = next(line for line in lines if VERIFIER.encode() in line)
    from nemo_gym_checkpoint_plugin._storage.writer import CheckpointWriter

    copy = tmp_path / "copy"
    CheckpointWriter(copy, "environment", "env_one", "ck-dup").write([orjson.loads(line) for line in [*lines, tagged]])
    with pytest.raises(InvalidCheckpointState, match=f"r[12].*{VERIFIER}.*twice"):
        read_checkpoint(copy, "environment", "env_one")
