"""Child process for the incremental crash test: three published checkpoints, then SIGKILL inside a fourth.

Usage: python crash_incremental_writer.py ROOT COUNT RECORD_BYTES
ROOT is a directory or an s3:// URL. step-1 is full; step-2 and step-3 change one episode each and
refer to the rest; each is published with its participants index, and "published step-N" printed.
step-4 changes one more episode and prints "paused" inside its records, then blocks on stdin
(the parent SIGKILLs it there). One backend object writes all four, as one server process does.
"""

from __future__ import annotations

import sys

from nemo_gym_checkpoint_plugin._plugins import get_storage_backend, make_plugin_manager
from nemo_gym_checkpoint_plugin._settings import StorageSettings
from nemo_gym_checkpoint_plugin._storage.index import write_participants_index
from nemo_gym_checkpoint_plugin.api import Versioned

root, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
backend = get_storage_backend(
    make_plugin_manager(load_entry_points=False), StorageSettings(backend="fsspec" if "://" in root else "local")
)
versions = dict.fromkeys(range(count), 0)


def records(pause: bool = False):  # noqa: ANN201
    for index in range(count):
        if pause and index == count // 2:
            print("paused", flush=True)
            sys.stdin.readline()
        episode = {"rollout_id": f"r{index}", "attempt": 0}
        version = versions[index]
        yield Versioned(episode, version, {"episode_id": episode, "v": version, "blob": "x" * size})


for step in (1, 2, 3, 4):
    if step > 1:
        versions[step] += 1
    name = f"step-{step}"
    manifest = backend.open_writer(f"{root}/{name}", "environment", "env", name).write(records(pause=step == 4))
    write_participants_index(
        f"{root}/{name}",
        name,
        [{"kind": "environment", "instance": "env", "records_sha256": manifest["records_sha256"]}],
    )
    print(f"published {name} schema_version {manifest['schema_version']}", flush=True)
