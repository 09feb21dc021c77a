"""Storage throughput against its floor, measured in the same run.

Writes N records of B bytes through the built-in storage backend (commit) and
reads them back with verification (restore); beside each, the floor: orjson
encode + sha256 + a plain write of the same bytes (commit floor), and a plain
read + sha256 + orjson decode (restore floor). Prints a table, then one JSON
object as its last line.

    .venv/bin/python benchmarks/storage.py [--records 1000] [--record-bytes 358400] [--repeat 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import orjson

from nemo_gym_checkpoint_plugin._plugins import get_storage_backend, make_plugin_manager


def make_records(count: int, record_bytes: int) -> list[dict]:
    """Agent-like records: a few messages of text, token ids and logprobs, padded to the size."""
    records = []
    for index in range(count):
        record = {
            "episode_id": {"rollout_id": f"rollout-{index:06d}", "attempt": 0},
            "step": index % 7,
            "messages": [
                {"role": "user", "content": "Solve the task. " * 50},
                {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather", "arguments": "{}"}]},
            ],
            "token_ids": list(range(index, index + 2000)),
            "logprobs": [-0.001 * (i % 97) for i in range(2000)],
            "padding": "",
        }
        base = len(orjson.dumps(record))
        record["padding"] = "x" * max(0, record_bytes - base - 1)
        records.append(record)
    return records


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--record-bytes", type=int, default=350 * 1024)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measure; the best is reported")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)

    records = make_records(args.records, args.record_bytes)
    root = Path(tempfile.mkdtemp(prefix="ngc-bench-", dir=args.dir))
    backend = get_storage_backend(make_plugin_manager(load_entry_points=False), "local")
    runs = {"n": 0}

    def commit() -> None:
        runs["n"] += 1
        backend.open_writer(root / f"ckpt-{runs['n']}", "model", "policy_model", "bench").write(records)

    floor_path = root / "floor.jsonl"

    def floor_commit() -> None:
        sha = hashlib.sha256()
        floor_path.unlink(missing_ok=True)  # a new file each time, as a commit writes one
        with open(floor_path, "wb") as out:
            for record in records:
                line = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
                sha.update(line)
                out.write(line)
        sha.hexdigest()

    def floor_commit_durable() -> None:
        # Context only (not in the JSON): the same floor plus the fsync a commit must do, i.e. what
        # the disk itself costs for these bytes.
        floor_commit()
        with open(floor_path, "rb+") as out:
            os.fsync(out.fileno())

    def restore() -> None:
        result = backend.read(root / "ckpt-1", "model", "policy_model")
        assert len(result.records) == args.records

    def floor_restore() -> None:
        sha = hashlib.sha256()
        with open(floor_path, "rb") as src:
            for line in src:
                sha.update(line)
                orjson.loads(line)
        sha.hexdigest()

    try:
        figures = {}
        # Alternate measure and floor so both see the same machine state, and start each one with
        # no dirty pages left by the previous (os.sync, untimed): the kernel throttles writers once
        # too much unwritten data piles up, which would charge one run for another's writes.
        for _ in range(args.repeat):
            for name, fn in (
                ("commit_s", commit),
                ("floor_commit_s", floor_commit),
                ("floor_commit_durable_s", floor_commit_durable),
                ("restore_s", restore),
                ("floor_restore_s", floor_restore),
            ):
                for old in root.glob("ckpt-*"):
                    if old.name != "ckpt-1":
                        shutil.rmtree(old)
                os.sync()
                figures[name] = min(figures.get(name, float("inf")), best(fn, 1))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    record_bytes = len(orjson.dumps(records[0])) + 1
    print(f"{args.records} records of {record_bytes} bytes ({args.records * record_bytes / 1e6:.0f} MB)")
    print(
        f"commit  {figures['commit_s']:.3f} s   floor {figures['floor_commit_s']:.3f} s   "
        f"ratio {figures['commit_s'] / figures['floor_commit_s']:.2f}x"
    )
    print(
        f"        durable floor (floor + fsync) {figures['floor_commit_durable_s']:.3f} s   "
        f"ratio {figures['commit_s'] / figures['floor_commit_durable_s']:.2f}x"
    )
    print(
        f"restore {figures['restore_s']:.3f} s   floor {figures['floor_restore_s']:.3f} s   "
        f"ratio {figures['restore_s'] / figures['floor_restore_s']:.2f}x"
    )
    order = ("commit_s", "restore_s", "floor_commit_s", "floor_restore_s")
    summary = {"records": args.records, "record_bytes": record_bytes, **{k: round(figures[k], 4) for k in order}}
    print(orjson.dumps(summary).decode(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
