"""``ng-checkpoint verify`` and ``inspect`` of a checkpoint in an object store (the local S3 server).

The CLI runs as its own process, reaching the store only through the standard AWS variables
the session's S3 fixture exported; the secret they hold never appears in its output.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import orjson
import pytest

from nemo_gym_checkpoint_plugin._storage import objstore
from nemo_gym_checkpoint_plugin._storage.index import write_participants_index
from nemo_gym_checkpoint_plugin._storage.objstore import ObjectPath
from nemo_gym_checkpoint_plugin._storage.objstore_writer import ObjectStoreWriter

PARTICIPANTS = [("environment", "env"), ("model", "policy_model"), ("agent", "agent"), ("resources", "tools")]
NG_CHECKPOINT = [sys.executable, "-m", "nemo_gym_checkpoint_plugin.cli"]


def good_checkpoint(url: str, checkpoint_id: str = "step-7") -> str:
    manifests = []
    for number, (kind, instance) in enumerate(PARTICIPANTS):
        records = [
            {"episode_id": {"rollout_id": f"r{i}", "attempt": i % 2}, "owner": instance} for i in range(number + 2)
        ]
        manifests.append(ObjectStoreWriter(url, kind, instance, checkpoint_id).write(records))
    write_participants_index(
        url,
        checkpoint_id,
        [{"kind": m["kind"], "instance": m["instance"], "records_sha256": m["records_sha256"]} for m in manifests],
    )
    return url


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*NG_CHECKPOINT, *args], capture_output=True, text=True, timeout=120)


def key(url: str, *parts: str) -> str:
    return "/".join([ObjectPath(url).native, *parts])


def records_key(url: str, kind: str, instance: str) -> str:
    manifest = orjson.loads(objstore.filesystem("s3").cat_file(key(url, "gym", kind, instance, "manifest.json")))
    return key(url, "gym", kind, instance, manifest["records_file"])


def test_verify_of_a_good_checkpoint_in_s3_exits_0_and_never_prints_the_secret(s3_server, s3_dir) -> None:  # noqa: ANN001
    good_checkpoint(s3_dir)
    done = run_cli("verify", s3_dir + "/")
    assert done.returncode == 0, done.stderr
    for kind, instance in PARTICIPANTS:
        assert f"ok    {kind}/{instance}  step-7" in done.stdout
    assert done.stderr == ""
    shown = run_cli("inspect", "--json", s3_dir)
    assert shown.returncode == 0, shown.stderr
    document = orjson.loads(shown.stdout)
    assert [p["participant"] for p in document["participants"]] == sorted(f"{k}/{i}" for k, i in PARTICIPANTS)
    assert all(p["ok"] and p["records_bytes"] > 0 for p in document["participants"])
    for output in (done.stdout, done.stderr, shown.stdout, shown.stderr):
        assert s3_server.secret not in output and s3_server.key_id not in output


def test_verify_refuses_a_tampered_records_object_by_name(s3_dir) -> None:  # noqa: ANN001
    good_checkpoint(s3_dir)
    fs = objstore.filesystem("s3")
    target = records_key(s3_dir, "model", "policy_model")
    # Same length, still JSON, still valid records: only the digest can tell.
    fs.pipe_file(target, fs.cat_file(target).replace(b'"policy_model"', b'"policy_modex"', 1))
    done = run_cli("verify", s3_dir)
    assert done.returncode == 1
    assert "FAIL  model/policy_model: " in done.stdout and "digest does not match the manifest" in done.stdout
    assert "1 of 4 participant(s) do not verify: model/policy_model" in done.stderr


def test_verify_refuses_a_partial_upload_and_a_missing_participant_by_name(s3_dir) -> None:  # noqa: ANN001
    good_checkpoint(s3_dir)
    fs = objstore.filesystem("s3")
    target = records_key(s3_dir, "agent", "agent")
    fs.pipe_file(target, fs.cat_file(target)[:-10])
    fs.rm(key(s3_dir, "gym", "resources", "tools"), recursive=True)
    done = run_cli("verify", "--json", s3_dir)
    assert done.returncode == 1
    problems = {p["participant"]: p["problem"] for p in orjson.loads(done.stdout)["participants"] if not p["ok"]}
    assert "truncated line" in problems["agent/agent"]
    assert "listed in participants.json but" in problems["resources/tools"]


def test_verify_warns_about_an_object_no_manifest_references(s3_dir) -> None:  # noqa: ANN001
    good_checkpoint(s3_dir)
    stray = key(s3_dir, "gym", "model", "policy_model", f"records-{'0' * 64}.jsonl")
    objstore.filesystem("s3").pipe_file(stray, b"left by a SIGKILLed upload\n")
    done = run_cli("verify", s3_dir)
    assert done.returncode == 0, done.stderr
    assert f"records-{'0' * 64}.jsonl: not referenced by any manifest" in done.stderr


def test_verify_of_an_empty_prefix_and_of_a_url_with_credentials(s3_dir) -> None:  # noqa: ANN001
    empty = run_cli("verify", "--json", s3_dir + "/nothing-here")
    assert empty.returncode == 1
    assert orjson.loads(empty.stdout)["error"]["code"] == "checkpoint_unreadable"
    secret = run_cli("verify", "s3://AKIAEXAMPLE:supersecretvalue@bucket/run")
    assert secret.returncode == 2 and "must not carry credentials" in secret.stderr
    assert "supersecretvalue" not in secret.stdout + secret.stderr


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed here")
def test_a_url_whose_filesystem_is_not_installed_is_named() -> None:
    done = run_cli("verify", "gs://some-bucket/run")
    assert done.returncode == 1
    assert "gs:// is not available" in done.stderr and "gcsfs" in done.stderr


def test_a_commit_is_refused_an_object_store_prefix_holding_another_checkpoint(s3_dir) -> None:  # noqa: ANN001
    from nemo_gym_checkpoint_plugin._storage.occupied import other_checkpoints

    assert other_checkpoints(s3_dir, "step-8") == []  # an empty prefix holds nothing
    good_checkpoint(s3_dir)
    # The listing reads the store as the filesystem: the index and every manifest naming another id.
    found = other_checkpoints(s3_dir, "step-8")
    assert found[0] == f"{s3_dir}/gym/participants.json lists checkpoint 'step-7'"
    assert sorted(found[1:]) == sorted(
        f"{s3_dir}/gym/{kind}/{instance}/manifest.json is of checkpoint 'step-7'" for kind, instance in PARTICIPANTS
    )
    assert other_checkpoints(s3_dir, "step-7") == []  # its own checkpoint: a retried commit goes on
