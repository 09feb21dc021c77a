"""``ng-checkpoint inspect`` and ``verify``: offline checks of a checkpoint directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from nemo_gym_checkpoint_plugin._storage import CheckpointWriter
from nemo_gym_checkpoint_plugin._storage.index import write_participants_index
from nemo_gym_checkpoint_plugin.cli import build_parser, main

PARTICIPANTS = [("environment", "env"), ("model", "policy_model"), ("agent", "agent"), ("resources", "tools")]
NG_CHECKPOINT = [sys.executable, "-m", "nemo_gym_checkpoint_plugin.cli"]


def good_checkpoint(root: Path, checkpoint_id: str = "step-7", *, index: bool = True) -> Path:
    """Every participant committed, then (like a controller) the participants index."""
    manifests = []
    for number, (kind, instance) in enumerate(PARTICIPANTS):
        records = [
            {"episode_id": {"rollout_id": f"r{i}", "attempt": i % 2}, "owner": instance, "big": 2**70}
            for i in range(number + 2)
        ]
        manifests.append(CheckpointWriter(root, kind, instance, checkpoint_id).write(records, {"note": "x"}))
    if index:
        write_participants_index(
            root,
            checkpoint_id,
            [{"kind": m["kind"], "instance": m["instance"], "records_sha256": m["records_sha256"]} for m in manifests],
        )
    return root


def participant(root: Path, kind: str, instance: str) -> Path:
    return root / "gym" / kind / instance


def records_file(root: Path, kind: str, instance: str) -> Path:
    directory = participant(root, kind, instance)
    return directory / orjson.loads((directory / "manifest.json").read_bytes())["records_file"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*NG_CHECKPOINT, *args], capture_output=True, text=True, timeout=60)


def test_verify_a_good_checkpoint_exits_0(tmp_path):
    good_checkpoint(tmp_path)
    done = run_cli("verify", str(tmp_path))
    assert done.returncode == 0, done.stderr
    for kind, instance in PARTICIPANTS:
        assert f"ok    {kind}/{instance}  step-7" in done.stdout
    assert done.stderr == ""


def flip_a_byte(root: Path) -> str:
    path = records_file(root, "model", "policy_model")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return "model/policy_model"


def remove_records(root: Path) -> str:
    records_file(root, "agent", "agent").unlink()
    return "agent/agent"


def point_manifest_outside(root: Path) -> str:
    manifest_path = participant(root, "resources", "tools") / "manifest.json"
    manifest = orjson.loads(manifest_path.read_bytes())
    manifest["records_file"] = "../../../outside.jsonl"
    manifest_path.write_bytes(orjson.dumps(manifest))
    return "resources/tools"


def link_records_outside(root: Path) -> str:
    # A records file of the right name that is a symlink to a file outside the participant directory.
    path = records_file(root, "environment", "env")
    outside = root / "outside.jsonl"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    os.symlink(outside, path)
    return "environment/env"


def remove_manifest(root: Path) -> str:
    (participant(root, "model", "policy_model") / "manifest.json").unlink()
    return "model/policy_model"


@pytest.mark.parametrize(
    "corrupt", [flip_a_byte, remove_records, point_manifest_outside, link_records_outside, remove_manifest]
)
def test_verify_a_corrupted_checkpoint_fails_naming_the_participant(tmp_path, corrupt):
    good_checkpoint(tmp_path)
    bad = corrupt(tmp_path)
    done = run_cli("verify", str(tmp_path))
    assert done.returncode == 1
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert len(failed) == 1 and failed[0].startswith(f"FAIL  {bad}: ")
    assert f"do not verify: {bad}" in done.stderr
    # Every other participant still verifies and is listed as such.
    assert sum(line.startswith("ok    ") for line in done.stdout.splitlines()) == len(PARTICIPANTS) - 1


def test_verify_messages_say_what_is_wrong(tmp_path, capsys):
    good_checkpoint(tmp_path)
    flip_a_byte(tmp_path)
    remove_records(tmp_path)
    point_manifest_outside(tmp_path)
    assert main(["verify", str(tmp_path), "--json"]) == 1
    report = orjson.loads(capsys.readouterr().out)
    problems = {p["participant"]: p["problem"] for p in report["participants"] if not p["ok"]}
    assert report["ok"] is False
    assert "digest" in problems["model/policy_model"] or "not JSON" in problems["model/policy_model"]
    assert "is missing" in problems["agent/agent"]
    assert "not a records file name" in problems["resources/tools"]


def test_verify_refuses_a_directory_mixing_checkpoints(tmp_path, capsys):
    good_checkpoint(tmp_path)
    CheckpointWriter(tmp_path, "model", "second_model", "step-8").write([])
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "mixes step-7, step-8" in out and "[" not in out


def test_verify_of_a_directory_without_checkpoint(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 1
    assert "not a checkpoint directory" in capsys.readouterr().err
    (tmp_path / "gym").mkdir()
    assert main(["verify", str(tmp_path)]) == 1
    assert "holds no participant directories" in capsys.readouterr().err


def test_inspect_lists_participants_counts_sizes_ids(tmp_path, capsys):
    good_checkpoint(tmp_path)
    assert main(["inspect", str(tmp_path), "--episodes"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["KIND", "INSTANCE", "CHECKPOINT", "RECORDS", "BYTES", "SHA256", "STATE"]
    model_row = next(line for line in lines if line.startswith("model "))
    size = records_file(tmp_path, "model", "policy_model").stat().st_size
    assert model_row.split()[:5] == ["model", "policy_model", "step-7", "3", str(size)]
    assert "model/policy_model: r0 r1-a1 r2" in out

    assert main(["inspect", str(tmp_path), "--json"]) == 0
    report = orjson.loads(capsys.readouterr().out)
    by_name = {p["participant"]: p for p in report["participants"]}
    assert by_name["resources/tools"]["record_count"] == 5
    assert by_name["resources/tools"]["extras"] == ["note"]
    assert by_name["resources/tools"]["records_bytes"] == records_file(tmp_path, "resources", "tools").stat().st_size


def test_every_command_has_help(capsys):
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # noqa: SLF001 - the parser's own registry
    assert set(commands) == {
        "status",
        "prepare",
        "commit",
        "resume",
        "restore",
        "retire",
        "forget",
        "renew",
        "inspect",
        "verify",
        "enable",
        "collect",
        "gc",
    }
    for command in commands:
        with pytest.raises(SystemExit) as exited:
            main([command, "--help"])
        assert exited.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: ng-checkpoint {command}") and "--json" in out


def test_console_script_is_declared():
    import importlib.metadata

    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("ng-checkpoint") == "nemo_gym_checkpoint_plugin.cli:main"


@pytest.mark.parametrize("special", ["fifo_manifest", "fifo_records", "dir_records"])
def test_verify_refuses_special_files_without_hanging(tmp_path, special):
    good_checkpoint(tmp_path)
    directory = participant(tmp_path, "agent", "agent")
    target = directory / "manifest.json" if special == "fifo_manifest" else records_file(tmp_path, "agent", "agent")
    target.unlink()
    os.mkfifo(target) if special.startswith("fifo") else target.mkdir()
    done = run_cli("verify", str(tmp_path))  # bounded by run_cli's timeout: a hang fails the test
    assert done.returncode == 1, done.stderr
    assert "FAIL  agent/agent: " in done.stdout and "not a regular file" in done.stdout
    assert "Traceback" not in done.stderr


def test_verify_refuses_a_repeated_capture_key_naming_it(tmp_path, capsys):
    good_checkpoint(tmp_path)
    CheckpointWriter(tmp_path, "environment", "env2", "step-7").write(
        [{"episode_id": {"rollout_id": "x", "attempt": 2}, "n": n} for n in range(2)]
    )
    assert main(["verify", str(tmp_path)]) == 1
    assert "FAIL  environment/env2: " in (out := capsys.readouterr().out) and "repeats episode x-a2" in out


def test_verify_fails_naming_a_participant_the_index_lists_and_the_directory_lacks(tmp_path, capsys):
    good_checkpoint(tmp_path)
    import shutil

    shutil.rmtree(tmp_path / "gym" / "resources")
    assert main(["verify", str(tmp_path), "--json"]) == 1
    report = orjson.loads(capsys.readouterr().out)
    problems = {p["participant"]: p["problem"] for p in report["participants"] if not p["ok"]}
    assert list(problems) == ["resources/tools"] and "is missing" in problems["resources/tools"]


def test_verify_without_an_index_warns_and_still_verifies(tmp_path):
    good_checkpoint(tmp_path, index=False)
    done = run_cli("verify", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "warning: " in done.stderr and "no gym/participants.json" in done.stderr


def test_verify_warns_about_unreferenced_files_and_still_exits_0(tmp_path, capsys):
    good_checkpoint(tmp_path)
    directory = participant(tmp_path, "model", "policy_model")
    (directory / ".records.0123.tmp").write_bytes(b"half a write")
    (directory / f"records-{'a' * 64}.jsonl").write_bytes(b"an aborted write's records\n")
    assert main(["verify", str(tmp_path), "--json"]) == 0
    captured = capsys.readouterr()
    report = orjson.loads(captured.out)
    assert report["ok"] is True
    assert sorted(Path(w.split(":")[0]).name for w in report["warnings"]) == [
        ".records.0123.tmp",
        f"records-{'a' * 64}.jsonl",
    ]
    assert all("not referenced by any manifest" in w for w in report["warnings"])
    # With --json everything is told once, in the document.
    assert captured.err == ""
    assert main(["verify", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("warning: ") == 2 and "not referenced by any manifest" in captured.err
