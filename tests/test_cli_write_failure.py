"""A commit whose write fails on the filesystem: the CLI says what happened and where.

The participant's ``WriteFailed`` keeps the protocol's code (``invalid_checkpoint_state``);
its detail names the cause in words and the path, and ``ng-checkpoint commit`` prints both.
Real participant servers (uvicorn processes with the real control plane and local storage).
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from coord_support import FOUR, TOKEN, start_participants, stop_participants

from nemo_gym_checkpoint_plugin.cli import main

pytestmark = pytest.mark.slow


def test_a_commit_into_an_unwritable_place_names_the_cause_and_the_path(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("NG_CHECKPOINT_TOKEN", TOKEN)
    monkeypatch.delenv("NG_CHECKPOINT_CONFIG", raising=False)
    servers = start_participants(tmp_path, [dict(FOUR[0]), dict(FOUR[1])])
    # A regular file where a directory must go: refused as ENOTDIR even for root (modes would not stop root).
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    target = blocker / "ckpt"
    where = [arg for s in servers for arg in ("--url", s.url)]
    try:
        assert main(["prepare", "step-1", *where]) == 0
        capsys.readouterr()
        assert main(["commit", "step-1", *where, "--dir", str(target), "--all"]) == 1
        err = capsys.readouterr().err
        assert "invalid_checkpoint_state" in err and "not a directory" in err, err
        assert str(blocker) in err, err
        assert main(["--json", "commit", "step-1", *where, "--dir", str(target), "--all"]) == 1
        failures = orjson.loads(capsys.readouterr().out)["error"]["failures"]
        assert failures and all(f["code"] == "invalid_checkpoint_state" for f in failures)
        assert any("not a directory" in f["detail"] and str(blocker) in f["detail"] for f in failures), failures
        assert main(["resume", "step-1", *where]) == 0
    finally:
        stop_participants(servers)
