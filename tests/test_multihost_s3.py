"""A deployment split across hosts sharing no directory, checkpointed in S3; all hosts killed, restored on new ones.

Network namespaces made by the test (``multihost_support.Lan``) stand for machines: three hosts,
each with its own address and directory, on a bridge in a hub namespace that holds the S3 server
and the controller (``multihost_driver.py``, run there). The scenario is ``make demo``'s process
test (``crash_scenario.run_scenario``): rollouts in flight, a commit into ``s3://``, every host
SIGKILLed and deleted with its disk, fresh hosts, a restore from the store, every rollout
finished from where it was. Skipped where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from multihost_support import Lan, lan_supported

HERE = Path(__file__).parent
TOKEN = "multihost-s3-token"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        sys.platform != "linux" or not lan_supported(),
        reason="needs named network namespaces, a bridge and veth pairs (Linux, root, iproute2)",
    ),
]


def test_every_host_killed_and_the_checkpoint_restored_from_s3_on_fresh_hosts(tmp_path: Path) -> None:
    lan = Lan()
    try:
        done = subprocess.run(
            lan.argv(
                lan.hub, [sys.executable, str(HERE / "multihost_driver.py"), lan.tag, lan.prefix, str(tmp_path), TOKEN]
            ),
            capture_output=True,
            text=True,
            timeout=900,
            cwd=HERE,
        )
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        report = orjson.loads(done.stdout.strip().splitlines()[-1])
    finally:
        lan.close()
    assert lan.namespaces() == []  # every namespace, and every process in it, gone
    result = report["result"]
    continued, restarts = [f"cont-{i}" for i in range(4)], [f"rest-{i}" for i in range(2)]
    # Each server on its own host's address, nothing on loopback only or on every address.
    addresses = report["addresses"]
    for generation in ("1", "2"):
        for host, address in addresses.items():
            listening = report["listening"][f"{host}-{generation}"]
            assert listening and all(entry.startswith(f"{address}:") for entry in listening), (host, listening)
    # The checkpoint: in the store only, every participant in it; verify exits 0.
    assert result["checkpoint_dir"].startswith("s3://")
    assert "gym/participants.json" in report["objects"]
    assert {o.split("/")[1] for o in report["objects"] if o.startswith("gym/") and o.count("/") == 3} == {
        "environment",
        "model",
        "agent",
        "resources",
    }
    assert report["verify"]["status"] == 0, report["verify"]
    assert report["hosts_left"] == [] and report["leaks"] == []
    # The scenario, as the single-host e2e test asserts it, counted by the fresh servers.
    assert result["blocked_before_release"] == 0 and result["prepare"]["ready"] is True
    assert result["commit_boundaries"] == {"seeded": len(continued)}
    assert result["restored"] == [f"{r}-a1" for r in continued]
    assert result["continued"] == continued and result["restarted"] == restarts
    for rollout, reply in result["replies"].items():
        assert reply["failure"] is None, (rollout, reply["failure"])
        assert reply["episode_id"] == {"rollout_id": rollout, "attempt": 1}
        assert reply["result"]["reward"] == 1.0, rollout
    assert result["seeds_before"] == dict.fromkeys(continued + restarts, 1)
    assert result["seeds_after"] == dict.fromkeys(restarts, 1)
