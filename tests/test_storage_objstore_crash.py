"""SIGKILL a child committing into S3 at many points: complete checkpoints restore, incomplete ones are refused.

The child (``crash_objstore_writer.py``) writes two participants (the first one's records in a multipart
upload) and the participants index into the session's local S3 server, and stops at a named point:
inside the records, after the first uploaded part, with the records object complete but no manifest,
just before and just after a manifest's create, before the index; or it is killed while running. A
participant with a manifest restores whole; one without is refused; an index is there only when every
participant it lists is complete. Committing again into the same prefix then completes.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState
from nemo_gym_checkpoint_plugin._storage import objstore
from nemo_gym_checkpoint_plugin._storage.index import check_participants_index, read_participants_index
from nemo_gym_checkpoint_plugin._storage.location import lexists
from nemo_gym_checkpoint_plugin._storage.objstore import ObjectPath
from nemo_gym_checkpoint_plugin._storage.reader import read_checkpoint

HERE = Path(__file__).parent
COUNT = 40
SIZE = 1 << 20  # 40 MiB for environment/env: a multipart upload of three parts
PARTICIPANTS = {("environment", "env"): COUNT, ("model", "policy_model"): 3}


def run_and_kill(url: str, pause_at: str, kill_after: str | None = None) -> list[str]:
    """Start the writer; SIGKILL it once it pauses (or prints a line starting with ``kill_after``)."""
    seen: list[str] = []
    with subprocess.Popen(
        [sys.executable, str(HERE / "crash_objstore_writer.py"), url, str(COUNT), str(SIZE), pause_at],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            for line in child.stdout:
                seen.append(line.strip())
                if seen[-1] == "paused" or (kill_after is not None and seen[-1].startswith(kill_after)):
                    child.send_signal(signal.SIGKILL)
                    break
        finally:
            child.kill()
            child.wait(timeout=60)
    return seen


def outcome(url: str) -> dict[str, str]:
    """Each participant ``complete`` (restores whole) or ``refused``; ``index`` present or not."""
    result = {}
    for (kind, instance), count in PARTICIPANTS.items():
        directory = ObjectPath(url) / "gym" / kind / instance
        if lexists(directory / "manifest.json"):
            restored = read_checkpoint(url, kind, instance)
            assert [r["episode_id"]["rollout_id"] for r in restored.records] == [f"r{i}" for i in range(count)]
            result[instance] = "complete"
        else:
            with pytest.raises(InvalidCheckpointState, match="no manifest.json"):
                read_checkpoint(url, kind, instance)
            result[instance] = "refused"
    index = read_participants_index(url)
    if index is not None:
        check_participants_index(url)  # every participant it lists is there, with its digest
    result["index"] = "present" if index is not None else "absent"
    return result


def env_records(url: str) -> list[str]:
    prefix = (ObjectPath(url) / "gym" / "environment" / "env").native
    return [name for name in objstore.filesystem("s3").find(prefix) if name.rsplit("/", 1)[-1].startswith("records-")]


NOTHING = {"env": "refused", "policy_model": "refused", "index": "absent"}
ENV_ONLY = {"env": "complete", "policy_model": "refused", "index": "absent"}
BOTH = {"env": "complete", "policy_model": "complete", "index": "absent"}
ALL = {"env": "complete", "policy_model": "complete", "index": "present"}

PAUSES = [
    ("before", NOTHING),
    ("record:env:17", NOTHING),
    ("s3:upload_part:", NOTHING),  # one part of three uploaded: no object at all yet
    ("s3:complete_multipart_upload:", NOTHING),  # the records object complete, no manifest
    ("s3-before:put_object:env/manifest.json", NOTHING),
    ("s3:put_object:env/manifest.json", ENV_ONLY),  # the create acknowledged: published
    ("record:policy_model:1", ENV_ONLY),
    ("s3-before:put_object:gym/participants.json", BOTH),
    ("indexed", ALL),
]


@pytest.mark.slow
@pytest.mark.parametrize(("pause_at", "expected"), PAUSES, ids=[p for p, _ in PAUSES])
def test_sigkill_paused_at_a_point_leaves_complete_or_refused(s3_dir: str, pause_at: str, expected: dict) -> None:
    seen = run_and_kill(s3_dir, pause_at)
    assert seen[-1] == "paused", seen[-5:]
    assert outcome(s3_dir) == expected
    if pause_at == "s3:upload_part:":
        assert env_records(s3_dir) == []  # an unfinished multipart upload is no object
    if pause_at == "s3:complete_multipart_upload:":
        assert len(env_records(s3_dir)) == 1  # an orphan, never vouched for by a manifest
    # The prefix stays usable: committing the same checkpoint again completes (or returns what is there).
    assert run_and_kill(s3_dir, "none")[-1] == "indexed"
    assert outcome(s3_dir) == ALL and len(env_records(s3_dir)) == 1


RUNNING = [f"record:env:{k}" for k in random.Random(28).sample(range(COUNT), 3)] + [
    "s3:upload_part:",
    "s3-before:complete_multipart_upload:",
    "s3:put_object:",
    "record:policy_model:",
]


@pytest.mark.slow
@pytest.mark.parametrize("kill_after", RUNNING)
def test_sigkill_while_running_leaves_complete_or_refused(s3_dir: str, kill_after: str) -> None:
    seen = run_and_kill(s3_dir, "none", kill_after)
    result = outcome(s3_dir)  # asserts each participant restores whole or is refused, the index sound
    if "published:env" not in seen:
        assert result["index"] == "absent"
    assert run_and_kill(s3_dir, "none")[-1] == "indexed"
    assert outcome(s3_dir) == ALL
