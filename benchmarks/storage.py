"""Storage throughput against its floor, measured in the same run.

Writes N records of B bytes through the built-in storage backend (commit) and
reads them back with verification (restore); beside each, the floor: orjson
encode + sha256 + a plain write of the same bytes (commit floor), and a plain
read + sha256 + orjson decode (restore floor). Then an incremental commit: the
same records as ``Versioned`` ones, ``--changed`` of them changed since a full
checkpoint of them in a sibling directory (the rest referred to, never encoded),
against the full commit of the same run, and the restore of that incremental
checkpoint. Each measure and floor alternate, best of ``--repeat``; wall time
and the process's CPU time (``time.process_time``: what a loaded machine's other
work does not inflate). Prints a table, then one JSON object as its last line.

    .venv/bin/python benchmarks/storage.py [--records 1000] [--record-bytes 358400] [--repeat 3] [--changed 0.1]
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


def timed(fn) -> tuple[float, float]:
    """``(wall seconds, CPU seconds of this process)`` of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--record-bytes", type=int, default=350 * 1024)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measure; the best is reported")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument(
        "--changed", type=float, default=0.1, help="share of records changed for the incremental commit"
    )
    args = parser.parse_args(argv)
    # Here, not at the top: storage_cost.py imports make_records in baseline trees that lack it.
    from nemo_gym_checkpoint_plugin.api import Versioned

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

    # The incremental case: a full checkpoint of the records as Versioned ones (untimed), then each
    # timed commit starts from it again with every tenth record changed (a new version and content).
    every = max(1, round(1 / args.changed)) if args.changed > 0 else args.records + 1
    changed = [{**r, "step": r["step"] + 1} if i % every == 0 else r for i, r in enumerate(records)]

    def versioned(items: list[dict], bump: bool) -> list[Versioned]:
        return [Versioned(r["episode_id"], 1 if bump and i % every == 0 else 0, r) for i, r in enumerate(items)]

    backend.open_writer(root / "inc-base", "model", "policy_model", "base").write(versioned(records, False))
    base = backend.history.get("model", "policy_model")
    incremental_runs = {"n": 0, "bytes": 0}

    def incremental_commit() -> None:
        backend.history.set("model", "policy_model", base)
        incremental_runs["n"] += 1
        target = root / f"inc-{incremental_runs['n']}"
        manifest = backend.open_writer(target, "model", "policy_model", "bench").write(versioned(changed, True))
        assert manifest["schema_version"] == 2
        incremental_runs["bytes"] = (
            (target / "gym" / "model" / "policy_model" / manifest["records_file"]).stat().st_size
        )
        incremental_runs["last"] = incremental_runs["n"]

    def incremental_restore() -> None:
        result = backend.read(root / f"inc-{incremental_runs['last']}", "model", "policy_model")
        assert len(result.records) == args.records

    def floor_restore() -> None:
        sha = hashlib.sha256()
        with open(floor_path, "rb") as src:
            for line in src:
                sha.update(line)
                orjson.loads(line)
        sha.hexdigest()

    try:
        figures: dict[str, float] = {}
        cpu: dict[str, float] = {}
        # Alternate measure and floor so both see the same machine state, and start each one with
        # no dirty pages left by the previous (os.sync, untimed): the kernel throttles writers once
        # too much unwritten data piles up, which would charge one run for another's writes.
        for _ in range(args.repeat):
            for name, fn in (
                ("commit_s", commit),
                ("floor_commit_s", floor_commit),
                ("floor_commit_durable_s", floor_commit_durable),
                ("incremental_commit_s", incremental_commit),
                ("restore_s", restore),
                ("floor_restore_s", floor_restore),
                ("incremental_restore_s", incremental_restore),
            ):
                for old in root.glob("ckpt-*"):
                    if old.name != "ckpt-1":
                        shutil.rmtree(old)
                for old in root.glob("inc-*"):
                    if old.name not in ("inc-base", f"inc-{incremental_runs.get('last')}"):
                        shutil.rmtree(old)
                os.sync()
                wall, used = timed(fn)
                figures[name] = min(figures.get(name, float("inf")), wall)
                cpu[name] = min(cpu.get(name, float("inf")), used)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    record_bytes = len(orjson.dumps(records[0])) + 1
    print(f"{args.records} records of {record_bytes} bytes ({args.records * record_bytes / 1e6:.0f} MB)")
    print(f"{'':<36}{'wall s':>8}{'ratio':>8}{'cpu s':>8}{'ratio':>8}")

    def row(label: str, name: str, against: str | None) -> None:
        ratios = ("", "")
        if against is not None:
            ratios = (f"{figures[name] / figures[against]:.2f}x", f"{cpu[name] / cpu[against]:.2f}x")
        print(f"{label:<36}{figures[name]:>8.3f}{ratios[0]:>8}{cpu[name]:>8.3f}{ratios[1]:>8}")

    row("commit", "commit_s", None)
    row("  vs floor (encode+hash+write)", "commit_s", "floor_commit_s")
    row("  vs durable floor (+ fsync)", "commit_s", "floor_commit_durable_s")
    row("restore", "restore_s", None)
    row("  vs floor (read+hash+decode)", "restore_s", "floor_restore_s")
    row(f"incremental commit ({args.changed:.0%} changed)", "incremental_commit_s", None)
    row("  full commit / incremental", "commit_s", "incremental_commit_s")
    row("incremental restore", "incremental_restore_s", None)
    row("  vs full restore", "incremental_restore_s", "restore_s")
    print(f"bytes written: full {args.records * record_bytes}, incremental {incremental_runs['bytes']}")
    order = ("commit_s", "restore_s", "floor_commit_s", "floor_restore_s")
    summary = {"records": args.records, "record_bytes": record_bytes, **{k: round(figures[k], 4) for k in order}}
    summary.update(
        floor_commit_durable_s=round(figures["floor_commit_durable_s"], 4),
        incremental_commit_s=round(figures["incremental_commit_s"], 4),
        incremental_restore_s=round(figures["incremental_restore_s"], 4),
        incremental_changed=args.changed,
        incremental_bytes=incremental_runs["bytes"],
        full_over_incremental=round(figures["commit_s"] / figures["incremental_commit_s"], 2),
        cpu={k: round(v, 4) for k, v in cpu.items()},
    )
    print(orjson.dumps(summary).decode(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
