"""One run of the storage benchmark's commit and restore, for ``cost_ab.py --storage``.

Only what every release's backend has (``get_storage_backend``, ``open_writer``, ``read``), so a
baseline tree runs it too. Prints one JSON object: best-of-``--repeat`` wall and CPU seconds
(``time.process_time``) of commit and restore, and of their floors in the same process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from storage import make_records  # noqa: E402

from nemo_gym_checkpoint_plugin._plugins import get_storage_backend, make_plugin_manager  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--record-bytes", type=int, default=350 * 1024)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    records = make_records(args.records, args.record_bytes)
    root = Path(tempfile.mkdtemp(prefix="ngc-storage-cost-"))
    backend = get_storage_backend(make_plugin_manager(load_entry_points=False), "local")
    floor = root / "floor.jsonl"

    def commit() -> None:
        shutil.rmtree(root / "ckpt", ignore_errors=True)
        backend.open_writer(root / "ckpt", "model", "policy_model", "bench").write(records)

    def restore() -> None:
        assert len(backend.read(root / "ckpt", "model", "policy_model").records) == args.records

    def floor_commit() -> None:
        floor.unlink(missing_ok=True)
        sha = hashlib.sha256()
        with open(floor, "wb") as out:
            for record in records:
                line = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
                sha.update(line)
                out.write(line)
            out.flush()
            os.fsync(out.fileno())

    def floor_restore() -> None:
        sha = hashlib.sha256()
        with open(floor, "rb") as src:
            for line in src:
                sha.update(line)
                orjson.loads(line)

    figures: dict[str, float] = {}
    try:
        for _ in range(args.repeat):
            for name, fn in (
                ("commit", commit),
                ("floor_commit_durable", floor_commit),
                ("restore", restore),
                ("floor_restore", floor_restore),
            ):
                os.sync()
                wall, cpu = time.perf_counter(), time.process_time()
                fn()
                for key, value in (
                    (f"{name}_s", time.perf_counter() - wall),
                    (f"{name}_cpu_s", time.process_time() - cpu),
                ):
                    figures[key] = min(figures.get(key, float("inf")), value)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({k: round(v, 4) for k, v in figures.items()}))


if __name__ == "__main__":
    main()
