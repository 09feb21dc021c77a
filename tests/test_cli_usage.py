"""``ng-checkpoint`` usage that needs no server: token and deployment sources, scopes, JSON errors, widths."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import yaml

from nemo_gym_checkpoint_plugin._storage import CheckpointWriter
from nemo_gym_checkpoint_plugin.cli import main
from nemo_gym_checkpoint_plugin.cli._where import UsageError, resolve_deployment

NOWHERE = "http://127.0.0.1:9"  # nothing listens there; every test here stops before any call


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("NG_CHECKPOINT_TOKEN", "NG_CHECKPOINT_CONFIG", "CLI_TEST_TOKEN", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def checkpoint(root: Path, holds: dict[tuple[str, str], list[str]], checkpoint_id: str = "step-1") -> Path:
    for (kind, instance), keys in holds.items():
        records = []
        for key in keys:
            rollout, _, attempt = key.partition("-a")
            records.append({"episode_id": {"rollout_id": rollout, "attempt": int(attempt or 0)}})
        CheckpointWriter(root, kind, instance, checkpoint_id).write(records)
    return root


def args(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"url": None, "config": None, "token_file": None, "token_env": None, **given})


def gym_config(path: Path, token_env: str | None) -> Path:
    config = {"model": {"responses_api_models": {"m": {"host": "127.0.0.1", "port": 9}}}}
    if token_env:
        config["checkpoint"] = {"enabled": True, "control_auth_token_env": token_env}
    path.write_text(yaml.safe_dump(config))
    return path


def test_token_precedence_explicit_then_config_then_ng_checkpoint_token(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("token-from-the-file\n")
    config = gym_config(tmp_path / "gym.yaml", "CLI_TEST_TOKEN")
    monkeypatch.setenv("NG_CHECKPOINT_TOKEN", "token-from-the-default")
    monkeypatch.setenv("CLI_TEST_TOKEN", "token-from-the-config")
    monkeypatch.setenv("OTHER", "token-from-the-env-var")

    explicit = resolve_deployment(args(config=str(config), token_file=str(token_file)))
    assert explicit.token == "token-from-the-file" and explicit.token_source == f"--token-file {token_file}"
    assert resolve_deployment(args(config=str(config), token_env="OTHER")).token == "token-from-the-env-var"
    from_config = resolve_deployment(args(config=str(config)))
    assert from_config.token == "token-from-the-config" and "CLI_TEST_TOKEN" in from_config.token_source
    # With --url too: NG_CHECKPOINT_TOKEN when nothing else gives a token.
    default = resolve_deployment(args(url=[NOWHERE]))
    assert default.token == "token-from-the-default" and default.token_source == "the variable NG_CHECKPOINT_TOKEN"
    # The config's variable unset: NG_CHECKPOINT_TOKEN still gives one.
    monkeypatch.delenv("CLI_TEST_TOKEN")
    assert resolve_deployment(args(config=str(config))).token == "token-from-the-default"
    # The token is never in what a Deployment shows of itself.
    assert "token-from-the-default" not in repr(default)


def test_token_file_missing_or_empty_is_a_usage_error_naming_the_path(tmp_path, capsys):
    missing = tmp_path / "no-such-token"
    assert main(["status", "--url", NOWHERE, "--token-file", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err == f"ng-checkpoint status: error: --token-file {missing} does not exist\n"
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    assert main(["prepare", "x", "--url", NOWHERE, "--token-file", str(empty)]) == 2
    assert capsys.readouterr().err == f"ng-checkpoint prepare: error: --token-file {empty} is empty\n"
    with pytest.raises(SystemExit) as both:
        main(["status", "--url", NOWHERE, "--token-file", str(empty), "--token-env", "X"])
    assert both.value.code == 2


RULE = "(the token must be at least 16 characters of printable ASCII, without spaces)"


def test_a_token_breaking_the_rule_is_a_usage_error_naming_where_it_came_from(tmp_path, capsys, monkeypatch):
    # Sent as it was, such a token could only earn a 401 from servers that would refuse to start with it.
    short = tmp_path / "short-token"
    short.write_text("abc\n")
    assert main(["status", "--url", NOWHERE, "--token-file", str(short)]) == 2
    assert capsys.readouterr().err == (
        f"ng-checkpoint status: error: the control token from --token-file {short} is 3 characters long {RULE}\n"
    )
    monkeypatch.setenv("NG_CHECKPOINT_TOKEN", "jeton-de-contrôle-0123456789")
    assert main(["status", "--url", NOWHERE]) == 2
    err = capsys.readouterr().err
    assert err == (
        "ng-checkpoint status: error: the control token from the variable NG_CHECKPOINT_TOKEN holds a "
        f"character outside printable ASCII or a space {RULE}\n"
    )
    monkeypatch.setenv("OTHER", "with a space 0123456789")
    with pytest.raises(UsageError, match=r"from the variable OTHER \(--token-env\) holds a character"):
        resolve_deployment(args(url=[NOWHERE], token_env="OTHER"))
    # The config's variable holding a bad token, nothing else: the config's own message.
    config = gym_config(tmp_path / "gym.yaml", "CLI_TEST_TOKEN")
    monkeypatch.delenv("NG_CHECKPOINT_TOKEN")
    monkeypatch.setenv("CLI_TEST_TOKEN", "too-short")
    with pytest.raises(UsageError) as refused:
        resolve_deployment(args(config=str(config)))
    assert str(refused.value).startswith(
        "the control token from the variable CLI_TEST_TOKEN "
        f"(checkpoint.control_auth_token_env) is 9 characters long {RULE}"
    )
    assert "too-short" not in str(refused.value)


def test_no_token_at_all_names_every_source(capsys):
    assert main(["status", "--url", NOWHERE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "NG_CHECKPOINT_TOKEN" in err and "--token-file" in err


def test_no_deployment_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.setenv("NG_CHECKPOINT_TOKEN", "cli-usage-test-token")
    assert main(["resume", "step-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no deployment" in err and "NG_CHECKPOINT_CONFIG" in err


def test_default_deployment_from_ng_checkpoint_config(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NG_CHECKPOINT_CONFIG", str(tmp_path / "missing.yaml"))
    assert main(["status"]) == 2
    missing = tmp_path / "missing.yaml"
    assert capsys.readouterr().err == (
        f"ng-checkpoint status: error: NG_CHECKPOINT_CONFIG names {missing}, which does not exist\n"
    )
    config = gym_config(tmp_path / "gym.yaml", "CLI_TEST_TOKEN")
    monkeypatch.setenv("NG_CHECKPOINT_CONFIG", str(config))
    monkeypatch.setenv("CLI_TEST_TOKEN", "cli-usage-test-token")
    deployment = resolve_deployment(args())
    # The variable names the deployment again in a pasted command: no options needed.
    assert deployment.source == str(config) and deployment.argv == []
    with pytest.raises(UsageError, match="NG_CHECKPOINT_CONFIG names"):
        monkeypatch.setenv("NG_CHECKPOINT_CONFIG", str(tmp_path))
        resolve_deployment(args())


def test_version_comes_from_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"ng-checkpoint {importlib.metadata.version('nemo-gym-checkpoint')}\n"


@pytest.mark.parametrize("where", ["before", "after"])
def test_json_before_or_after_the_command_and_for_offline_errors(tmp_path, capsys, where):
    def run(*argv: str) -> tuple[int, dict]:
        full = ["--json", *argv] if where == "before" else [*argv, "--json"]
        code = main(full)
        captured = capsys.readouterr()
        assert captured.err == ""  # the error is told once, in the document
        return code, orjson.loads(captured.out)

    code, document = run("verify", str(tmp_path / "nope"))
    assert code == 1 and document["error"] == {
        "code": "checkpoint_unreadable",
        "detail": f"{tmp_path / 'nope'} does not exist",
        "dir": str(tmp_path / "nope"),
    }
    code, document = run("inspect", str(tmp_path))
    assert code == 1 and document["error"]["code"] == "not_a_checkpoint"
    (tmp_path / "gym").mkdir()
    code, document = run("verify", str(tmp_path))
    assert code == 1 and document["ok"] is False and "no participant directories" in document["error"]["detail"]
    code, document = run("status", "--url", NOWHERE)
    assert code == 2 and document["error"]["code"] == "usage"


def test_verify_a_missing_dir_says_it_does_not_exist(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope")]) == 1
    assert capsys.readouterr().err == f"ng-checkpoint verify: error: {tmp_path / 'nope'} does not exist\n"


def test_restore_scope_is_checked_against_the_checkpoint(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NG_CHECKPOINT_TOKEN", "cli-usage-test-token")
    ckpt = checkpoint(tmp_path / "ckpt", {("model", "m"): ["r1", "r2-a1"], ("agent", "a"): ["r1"]})
    where = ["--url", NOWHERE, "--dir"]
    assert main(["restore", "x", *where, str(tmp_path / "nope"), "--all"]) == 2
    assert capsys.readouterr().err == f"ng-checkpoint restore: error: --dir {tmp_path / 'nope'} does not exist\n"
    assert main(["restore", "x", *where, str(ckpt), "--episode", "r1", "--episode", "r9"]) == 2
    err = capsys.readouterr().err
    assert "does not hold r9; it holds 2 episode(s): r1, r2-a1" in err and "[" not in err
    assert main(["restore", "x", *where, str(ckpt)]) == 2
    assert "restore needs its scope" in capsys.readouterr().err
    assert main(["restore", "x", *where, str(ckpt), "--all", "--episode", "r1"]) == 2
    assert "not both" in capsys.readouterr().err
    # A checkpoint that does not verify cannot list its episodes: exit 1, naming the participant.
    records = next((ckpt / "gym" / "agent" / "a").glob("records*.jsonl"))
    records.write_bytes(records.read_bytes() + b"{}\n")
    assert main(["restore", "x", *where, str(ckpt), "--all"]) == 1
    assert "agent/a:" in capsys.readouterr().err


def test_inspect_table_fits_80_columns(tmp_path):
    checkpoint(
        tmp_path,
        {("environment", "a_rather_long_environment_instance"): ["r1"], ("model", "policy_model"): ["r1"]},
        checkpoint_id="a-long-checkpoint-id-0001",
    )
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    done = subprocess.run(
        [sys.executable, "-m", "nemo_gym_checkpoint_plugin.cli", "inspect", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert max(len(line) for line in done.stdout.splitlines()) <= 80
    # A long cell wraps inside its column instead of running past the edge.
    header, *rows = done.stdout.splitlines()
    assert header.split() == ["KIND", "INSTANCE", "CHECKPOINT", "RECORDS", "BYTES", "SHA256", "STATE"]
    column = slice(header.index("INSTANCE"), header.index("CHECKPOINT"))
    until_next_row = rows[: next(i for i, row in enumerate(rows) if row.startswith("model"))]
    assert "".join(row[column].strip() for row in until_next_row) == "a_rather_long_environment_instance"
