"""``make demo``: checkpoint work in flight, crash it with SIGKILL, restore, finish.

Until the Gym deployment demo lands, this runs the storage layer end to end in
real processes: a worker process runs episodes step by step, commits a
checkpoint of every episode's last completed step while they are in flight, and
is SIGKILLed right after the checkpoint is durable. A fresh worker restores the
checkpoint (verifying it), continues every episode from its boundary, and
finishes. Steps are counted in a ledger the workers append to, so a repeated
step is seen by counting, not assumed. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import orjson

from nemo_gym_checkpoint_plugin.storage import CheckpointWriter, read_checkpoint

STEPS = 6
CHECKPOINT_AFTER = 3


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def worker(root: Path, rollouts: int, restore: bool) -> None:
    """Run every episode; the first worker checkpoints after CHECKPOINT_AFTER steps and waits to be killed."""
    ledger = open(root / "ledger.jsonl", "ab", buffering=0)  # noqa: SIM115 - lives as long as the process
    if restore:
        restored = read_checkpoint(root / "ckpt", "environment", "demo_env")
        episodes = {r["episode_id"]["rollout_id"]: r for r in restored.records}
    else:
        episodes = {f"rollout-{i:03d}": {"episode_id": {"rollout_id": f"rollout-{i:03d}", "attempt": 0},
                                         "boundary": 0, "total": 0} for i in range(rollouts)}
    stop_at = CHECKPOINT_AFTER if not restore else STEPS
    for step in range(1, STEPS + 1):
        for state in episodes.values():
            if state["boundary"] >= step or step > stop_at:
                continue
            state["total"] += step  # the "work" of this step
            state["boundary"] = step
            ledger.write(orjson.dumps({"rollout_id": state["episode_id"]["rollout_id"], "step": step}) + b"\n")
    if not restore:
        # Every episode is parked at a boundary: commit, then announce and wait for the crash.
        manifest = CheckpointWriter(root / "ckpt", "environment", "demo_env", "demo-1").write(episodes.values())
        print(orjson.dumps({"committed": manifest["record_count"]}).decode(), flush=True)
        sys.stdin.readline()
        return
    finished = [state for state in episodes.values() if state["boundary"] == STEPS]
    print(orjson.dumps({"finished": len(finished),
                        "correct": sum(s["total"] == STEPS * (STEPS + 1) // 2 for s in finished)}).decode(), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=48)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a new temporary one)")
    parser.add_argument("--worker", choices=["first", "restore"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="ng-checkpoint-demo-"))
    if args.worker:
        worker(root, args.rollouts, restore=args.worker == "restore")
        return 0

    root.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "nemo_gym_checkpoint_plugin.demo", "--dir", str(root),
               "--rollouts", str(args.rollouts), "--worker"]
    _say(f"starting a worker with {args.rollouts} rollouts of {STEPS} steps")
    with subprocess.Popen([*command, "first"], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as first:
        assert first.stdout is not None
        committed = orjson.loads(first.stdout.readline())["committed"]
        _say(f"checkpoint committed with {committed} episodes in flight at step {CHECKPOINT_AFTER}/{STEPS}")
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    _say(f"worker killed with SIGKILL (exit {first.returncode}); starting a fresh one that restores")
    second = subprocess.run([*command, "restore"], stdout=subprocess.PIPE, check=True)
    result = orjson.loads(second.stdout.splitlines()[-1])
    steps = Counter((row["rollout_id"], row["step"]) for row in map(orjson.loads, (root / "ledger.jsonl").open("rb")))
    rollouts_seen = {rollout for rollout, _ in steps}
    summary = {
        "rollouts": args.rollouts,
        "finished": result["finished"],
        "reward_1": result["correct"],
        "continued": committed,
        "restarted": 0,
        "lost": args.rollouts - result["finished"],
        "repeated_steps": sum(count - 1 for count in steps.values()),
        "checkpoint_dir": str(root / "ckpt"),
    }
    _say(f"restored and finished {result['finished']}/{args.rollouts} rollouts ({len(rollouts_seen)} seen)")
    print(orjson.dumps(summary).decode(), flush=True)
    return 0 if summary["lost"] == 0 and summary["repeated_steps"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
