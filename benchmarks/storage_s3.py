"""Storage throughput on an S3-compatible server against its floor, measured in the same run.

Starts the testing kit's local S3 server (moto's server mode on 127.0.0.1, from the ``test``
extras), then writes N records of B bytes through the ``fsspec`` storage backend (commit) and
reads them back with verification (restore). Beside each, the floor on the same server:
orjson encode + sha256 + one plain PUT of the same bytes (multipart, with the backend's part
size and parallelism), and one plain GET of the object + sha256 + orjson decode of each line.
Prints a table, then one JSON object as its last line.

    .venv/bin/python benchmarks/storage_s3.py [--records 1000] [--record-bytes 358400] [--repeat 3]

What it measures is the plugin's own cost over the store's: moto keeps objects in its own
process on this machine, so the absolute figures are this machine's, not a cloud store's.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).parent))
from storage import make_records  # noqa: E402 - the same records as benchmarks/storage.py

from nemo_gym_checkpoint_plugin._plugins import get_storage_backend, make_plugin_manager  # noqa: E402
from nemo_gym_checkpoint_plugin._settings import StorageSettings  # noqa: E402
from nemo_gym_checkpoint_plugin._storage import objstore, objstore_put  # noqa: E402
from nemo_gym_checkpoint_plugin.testing.s3_server import LocalS3Server  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--record-bytes", type=int, default=350 * 1024)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measure; the best is reported")
    args = parser.parse_args(argv)

    records = make_records(args.records, args.record_bytes)
    with LocalS3Server() as server:
        saved = server.apply()
        objstore.reset_filesystems()
        try:
            figures = _measure(server, records, args.repeat)
        finally:
            LocalS3Server.restore(saved)
    record_bytes = len(orjson.dumps(records[0])) + 1
    print(
        f"{args.records} records of {record_bytes} bytes ({args.records * record_bytes / 1e6:.0f} MB), "
        f"S3 server: moto on 127.0.0.1"
    )
    print(
        f"commit  {figures['commit_s']:.3f} s   floor (encode + sha256 + PUT) {figures['floor_commit_s']:.3f} s   "
        f"ratio {figures['commit_s'] / figures['floor_commit_s']:.2f}x"
    )
    print(f"        the PUT alone {figures['put_s']:.3f} s")
    print(
        f"restore {figures['restore_s']:.3f} s   floor (GET + sha256 + decode) {figures['floor_restore_s']:.3f} s   "
        f"ratio {figures['restore_s'] / figures['floor_restore_s']:.2f}x"
    )
    print(f"        the GET alone {figures['get_s']:.3f} s")
    order = ("commit_s", "restore_s", "floor_commit_s", "floor_restore_s")
    summary = {
        "records": args.records,
        "record_bytes": record_bytes,
        "store": "moto-s3",
        **{k: round(figures[k], 4) for k in order},
    }
    print(orjson.dumps(summary).decode(), flush=True)
    return 0


def _measure(server: LocalS3Server, records: list[dict], repeat: int) -> dict[str, float]:
    backend = get_storage_backend(make_plugin_manager(load_entry_points=False), StorageSettings(backend="fsspec"))
    fs = objstore.filesystem("s3")
    floor_key = f"{server.bucket}/floor/records.jsonl"
    runs = {"n": 0}

    def commit() -> None:
        runs["n"] += 1
        backend.open_writer(server.url(f"ckpt-{runs['n']}"), "model", "policy_model", "bench").write(records)

    def floor_commit() -> None:
        sha = hashlib.sha256()
        lines = []
        for record in records:
            line = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
            sha.update(line)
            lines.append(line)
        sha.hexdigest()
        fs.pipe_file(
            floor_key, b"".join(lines), chunksize=objstore_put.UPLOAD_PART, max_concurrency=objstore_put.UPLOAD_PARALLEL
        )

    encoded = b"".join(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE) for record in records)

    def put_only() -> None:
        # Context only (not in the JSON): the transfer alone, what the store itself costs for these bytes.
        fs.pipe_file(
            floor_key, encoded, chunksize=objstore_put.UPLOAD_PART, max_concurrency=objstore_put.UPLOAD_PARALLEL
        )

    def get_only() -> None:
        fs.cat_file(floor_key)

    def restore() -> None:
        result = backend.read(server.url("ckpt-1"), "model", "policy_model")
        assert len(result.records) == len(records)

    def floor_restore() -> None:
        data = fs.cat_file(floor_key)
        hashlib.sha256(data).hexdigest()
        for line in data.splitlines():
            orjson.loads(line)

    figures: dict[str, float] = {}
    # Alternate measure and floor so both see the same machine state.
    for _ in range(repeat):
        for name, fn in (
            ("commit_s", commit),
            ("floor_commit_s", floor_commit),
            ("put_s", put_only),
            ("restore_s", restore),
            ("floor_restore_s", floor_restore),
            ("get_s", get_only),
        ):
            started = time.perf_counter()
            fn()
            figures[name] = min(figures.get(name, float("inf")), time.perf_counter() - started)
            if name == "commit_s" and runs["n"] > 1:
                # Keep the server's memory to one checkpoint (ckpt-1, restored) and the floor's object.
                fs.rm(f"{server.bucket}/ckpt-{runs['n']}", recursive=True)
    return figures


if __name__ == "__main__":
    sys.exit(main())
