"""Two plugins on one real participant round-trip through commit, SIGKILL and restore.

A third-party plugin, discovered by the wheel's servers through the ``nemo_gym_checkpoint``
entry-point group (a distribution on ``PYTHONPATH``), opts in on the environment server only
(``attach``) and exports its own record for every episode in scope, beside the built-in
``EpisodeBook``. After the crash the fresh environment process hands it exactly its own
records and the scope; the built-in gets its own, and every continued rollout finishes.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from nemo_gym_checkpoint_plugin.testing.crash_scenario import new_deployment, run_scenario

pytestmark = pytest.mark.slow

TOKEN = "plugin-ownership-token"
CONTINUED = ["cont-own-0", "cont-own-1", "cont-own-2"]
RESTARTS = ["rest-own-0"]

PLUGIN_SOURCE = '''
"""A third-party checkpoint plugin: one note per episode, logged to SIDECAR_LOG on install."""
import json
import os

from nemo_gym_checkpoint_plugin._control import ParticipantExport
from nemo_gym_checkpoint_plugin._markers import hookimpl


@hookimpl
def attach(kind, instance):
    with open(os.environ["SIDECAR_LOG"], "a") as log:
        log.write(json.dumps({"attach": kind, "instance": instance}) + "\\n")
    return kind == "environment"


@hookimpl
def export(checkpoint_id, scope):
    keys = sorted(scope or ())
    with open(os.environ["SIDECAR_LOG"], "a") as log:
        log.write(json.dumps({"export": keys, "pid": os.getpid()}) + "\\n")
    return ParticipantExport(records=[
        {"episode_id": {"rollout_id": key, "attempt": 0}, "note": "sidecar of " + key} for key in keys
    ])


@hookimpl
def install(records, scope):
    entry = {
        "install": [[r.replacement.capture_key, dict(r.record)] for r in records],
        "scope": [e.capture_key for e in scope],
        "pid": os.getpid(),
    }
    with open(os.environ["SIDECAR_LOG"], "a") as log:
        log.write(json.dumps(entry) + "\\n")
'''


def _distribution(site: Path) -> None:
    """A minimal installed distribution: the module and its entry point (what pip would leave)."""
    (site / "sidecar_ckpt.py").write_text(PLUGIN_SOURCE)
    info = site / "sidecar_ckpt-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sidecar-ckpt\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[nemo_gym_checkpoint]\nsidecar = sidecar_ckpt\n")


def test_a_third_party_plugin_and_the_builtin_each_get_back_their_own_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    _distribution(site)
    log = tmp_path / "sidecar.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("SIDECAR_LOG", str(log))

    deployment = new_deployment(tmp_path / "work", TOKEN, step_mode="wait")
    deployment.start()
    try:
        result = asyncio.run(
            run_scenario(deployment, tmp_path / "ckpt", TOKEN, CONTINUED, RESTARTS, step_mode="wait", timeout=90)
        )
    finally:
        deployment.stop()

    entries = [json.loads(line) for line in log.read_text().splitlines()]
    # Every server (both runs) asked the plugin; only the environment kept it.
    assert {e["attach"] for e in entries if "attach" in e} == {"environment", "model", "agent", "resources"}
    [export] = [e for e in entries if "export" in e]
    assert export["export"] == CONTINUED
    [install] = [e for e in entries if "install" in e]
    assert install["pid"] != export["pid"]  # the fresh process after the SIGKILL
    assert install["install"] == [
        [
            f"{key}-a1",
            {"episode_id": {"rollout_id": key, "attempt": 0}, "note": f"sidecar of {key}", "plugin": "sidecar"},
        ]
        for key in CONTINUED
    ]
    assert install["scope"] == [f"{key}-a1" for key in CONTINUED]

    # The built-in got its own records: the continued rollouts resumed from their boundary and finished.
    assert result.restored == [f"{key}-a1" for key in CONTINUED]
    summary = result.summary()
    assert summary["finished"] == summary["rollouts"] == len(CONTINUED) + len(RESTARTS)
    assert summary["lost"] == 0 and summary["repeated_steps"] == 0
    for rollout in CONTINUED:
        assert result.replies[rollout]["result"]["reward"] == 1.0
