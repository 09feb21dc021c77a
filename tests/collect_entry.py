"""Run ``ng-checkpoint collect`` with an observer that logs events and can pause at one (for SIGKILL tests).

``python tests/collect_entry.py EVENTS PAUSE_AT -- <collect arguments>``: every checkpointer event
is appended to EVENTS as a JSON line; at the ``PAUSE_AT``-th occurrence of an event
(``published:2``; ``-`` never) the line is written and the collector blocks until it is killed (or
until the test creates ``EVENTS.continue``: it then goes on); several points, comma separated
(``prepare:1,published:1``), each wait for their own ``EVENTS.continue`` (removed as it goes on); a
``published`` event counts only when the checkpoint holds rows in flight (``continued``).
At ``restored`` the environment's boundary of every restored row is logged from the checkpoint,
so a test can tell which steps a continued row had completed before the crash; at ``resumed``
whether that checkpoint was published; at ``prepare`` what the checkpoint directory holds.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from nemo_gym_checkpoint_plugin._storage.reader import read_checkpoint
from nemo_gym_checkpoint_plugin.cli import build_parser
from nemo_gym_checkpoint_plugin.cli._collect import run_collect
from nemo_gym_checkpoint_plugin.cli._where import UsageError


def main() -> int:
    events_path, pause_at, separator, *argv = sys.argv[1:]
    assert separator == "--"
    # One pause point or several, comma separated (``prepare:1,published:1``): each waits for its own go.
    pauses = {(name, int(nth or 1)) for name, _, nth in (point.partition(":") for point in pause_at.split(","))}
    seen: Counter[str] = Counter()

    def log(entry: dict[str, Any]) -> None:
        with open(events_path, "a") as out:
            out.write(json.dumps(entry, default=str) + "\n")

    async def observe(event: str, data: dict[str, Any]) -> None:
        if event == "published" and not data.get("continued"):
            log({"event": "published_empty", **data})  # holds no row in flight: not counted
            return
        seen[event] += 1
        entry: dict[str, Any] = {"event": event, "n": seen[event], **{k: v for k, v in data.items() if k != "record"}}
        if event == "restored":
            records = read_checkpoint(data["path"], "environment", "single_agent_turn").records
            entry["boundaries"] = {r["episode_id"]["rollout_id"]: r["boundary"] for r in records}
        if event == "resumed":
            entry["published"] = data["record"].published
        if event == "prepare":
            # What the checkpoint directory holds as the attempt starts: [name, published] of each checkpoint.
            entry["dir"] = [
                [path.name, os.path.lexists(path / "collector" / "manifest.json")]
                for path in sorted(Path(root).glob("collect-*"))
            ]
        log(entry)
        if (event, seen[event]) in pauses:
            at = f"{event}:{seen[event]}"
            log({"event": "paused", "at": at})
            go = Path(f"{events_path}.continue")
            while not go.exists():  # until the test SIGKILLs this process, or lets it go on
                await asyncio.sleep(0.05)  # wait-ok: the test bounds its own wait for what follows
            if len(pauses) > 1:
                go.unlink()  # the next pause point waits for the test's next go
            log({"event": "continued", "at": at})

    args = build_parser().parse_args(["collect", *argv])
    root = args.checkpoint_dir
    try:
        return run_collect(args, observe=observe)
    except UsageError as exc:  # as ng-checkpoint's main reports it
        print(f"ng-checkpoint collect: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
