"""Child process for the object-store crash test: commits a checkpoint into S3, announcing (and optionally
pausing at) stages, so the parent can SIGKILL it exactly there.

Usage: python crash_objstore_writer.py URL COUNT RECORD_BYTES PAUSE_AT

Two participants (``environment/env``, large enough for a multipart upload, then ``model/policy_model``),
then the participants index, as a commit through the controller writes them. Stages: ``before``,
``record:<participant>:<k>``, and around every S3 request ``s3-before:<method>:<key tail>`` and
``s3:<method>:<key tail>`` (``upload_part``, ``complete_multipart_upload``, ``put_object``...), then
``published:<participant>``, ``indexed``. The first stage starting with PAUSE_AT prints "paused" and blocks
reading stdin (inside the S3 client's own event loop for S3 stages: every request stops there).
"""

from __future__ import annotations

import sys

import s3fs

from nemo_gym_checkpoint_plugin._storage.index import write_participants_index
from nemo_gym_checkpoint_plugin._storage.objstore_writer import ObjectStoreWriter

url, count, size, pause_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
paused = False


def stage(name: str) -> None:
    global paused
    print(name, flush=True)
    if not paused and pause_at != "none" and name.startswith(pause_at):
        paused = True
        print("paused", flush=True)
        sys.stdin.readline()


real_call = s3fs.S3FileSystem._call_s3


async def call_s3(self, method, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
    tail = "/".join(str(kwargs.get("Key", "")).split("/")[-2:])
    stage(f"s3-before:{method}:{tail}")
    result = await real_call(self, method, *args, **kwargs)
    stage(f"s3:{method}:{tail}")
    return result


s3fs.S3FileSystem._call_s3 = call_s3


def records(name: str, number: int, blob: int):  # noqa: ANN201
    for index in range(number):
        stage(f"record:{name}:{index}")
        yield {"episode_id": {"rollout_id": f"r{index}", "attempt": 0}, "blob": "x" * blob}


stage("before")
manifests = [
    ObjectStoreWriter(url, "environment", "env", "ckpt-1").write(records("env", count, size)),
]
stage("published:env")
manifests.append(ObjectStoreWriter(url, "model", "policy_model", "ckpt-1").write(records("policy_model", 3, 100)))
stage("published:policy_model")
write_participants_index(
    url,
    "ckpt-1",
    [{"kind": m["kind"], "instance": m["instance"], "records_sha256": m["records_sha256"]} for m in manifests],
)
stage("indexed")
