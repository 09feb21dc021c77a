"""``make fuzz``'s real-process part: random sequences of the two process machines, one per seed.

``python tests/fuzz_processes.py`` runs ``FUZZ_SEQUENCES`` sequences (default 1,000) of
``deployment_machine.DeploymentMachine`` (three in four) and ``collect_machine.CollectMachine`` (the
fourth) with seeds ``FUZZ_SEED``, ``FUZZ_SEED + 1``, ... (a random start when unset, printed), in
``FUZZ_JOBS`` lanes side by side (default ``DEFAULT_JOBS``). A lane is a process of its own with its own
zygote, its own two deployments (one per machine, forked from that zygote) on ports of its own slice; it
runs one sequence at a time, each seed handed to whichever lane is free, and reports each sequence to
this process, which alone prints, so each line and each violation report stays whole. Every violation
is printed with its seed and its steps; ``FUZZ_SEED=<seed> FUZZ_SEQUENCES=1 make fuzz`` replays it (the
same rules and arguments; the processes' timing may differ). ``FUZZ_STEPS`` bounds a deployment sequence
(default 18). The last line is exactly ``fuzz: N sequences, K violations``, N counting every lane's
sequences (also after Ctrl-C); the exit status is 1 when K > 0 (or a lane died), 130 when interrupted.
"""

from __future__ import annotations

import compileall
import json
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from collect_machine import CollectMachine, new_collect_deployment  # noqa: E402
from deployment_machine import VERIFY_SERVER, DeploymentMachine, new_machine_deployment  # noqa: E402
from seeded_machines import run_seeded  # noqa: E402

import nemo_gym_checkpoint_plugin  # noqa: E402
from nemo_gym_checkpoint_plugin.testing import ports, reaper  # noqa: E402
from nemo_gym_checkpoint_plugin.testing.deployment import Deployment, use_zygote  # noqa: E402
from nemo_gym_checkpoint_plugin.testing.zygote import Zygote  # noqa: E402

COLLECT_STEPS = 6
# Lanes when FUZZ_JOBS is unset: on this project's 2-core machine two ran 40 sequences as fast as three
# (three: a tenth more CPU, every core oversubscribed) and 1.5 times as fast as one (docs/development.md).
DEFAULT_JOBS = 2
# After Ctrl-C: how long lanes get to end the sequence they run (a lane the signal did not reach sees no
# more seeds), then to clean up after a SIGINT of their own, before they are killed.
_END_SECONDS = 10.0
_CLEANUP_SECONDS = 60.0


def warm_bytecode() -> None:
    """Write the plugin's bytecode once, so no forked server compiles it again: where
    ``PYTHONDONTWRITEBYTECODE`` is set, each would (0.5 s of CPU for the four servers, a fifth of their
    start), and a fuzz run starts servers thousands of times."""
    from nemo_gym_checkpoint_plugin import builtin_participants, hookspecs

    for package in (nemo_gym_checkpoint_plugin, builtin_participants, hookspecs):
        for directory in package.__path__:
            compileall.compile_dir(directory, quiet=2)
    compileall.compile_dir(VERIFY_SERVER, quiet=2)


def machine_of(seed: int) -> str:
    return "collect" if seed % 4 == 3 else "deployment"


# -- a lane ----------------------------------------------------------------------------------------


def run_lane(index: int, lanes: int, work: Path) -> int:
    """Run each seed read from stdin (one a line, until EOF); write each outcome as one JSON line."""
    # The outcomes go to the dispatcher through the stdout it gave; anything else printed here or below
    # (a library's warning) goes to stderr, so it never splits a line of theirs.
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    low, high = ports.PORT_RANGE
    width = (high - low) // lanes
    ports.PORT_RANGE = (low + index * width, low + (index + 1) * width)
    steps = int(os.environ.get("FUZZ_STEPS", "18"))
    run = reaper.new_run()
    reaper.start_watchdog(run)
    deployments: dict[str, Deployment] = {}
    zygote: Zygote | None = None
    interrupted = False
    try:
        zygote = Zygote()
        use_zygote(lambda: zygote)
        while line := sys.stdin.readline():
            seed = int(line)
            name = machine_of(seed)
            machine = DeploymentMachine if name == "deployment" else CollectMachine
            if name not in deployments:
                make = new_machine_deployment if name == "deployment" else new_collect_deployment
                deployments[name] = make(work / f"{name}-servers")
                deployments[name].start(timeout=240)
                machine.deployment, machine.work = deployments[name], work / name
                machine.work.mkdir()
            outcome = run_seeded(machine, seed, steps if name == "deployment" else COLLECT_STEPS)
            report = None if outcome.violation is None else outcome.report(name)
            results.write(json.dumps({"seed": seed, "name": name, "seconds": outcome.seconds, "report": report}) + "\n")
    except KeyboardInterrupt:
        interrupted = True
    except BrokenPipeError:
        pass  # the dispatcher is gone: clean up
    finally:
        # Ctrl-C (or `timeout -s INT`) reaches the whole process group, the zygote too, so a stop can be
        # interrupted again: each clean-up step is tried on its own, and the reaper sweeps what is left.
        steps_left = [*(d.stop for d in deployments.values()), lambda: use_zygote(None)]
        for step in [*steps_left, *([zygote.close] if zygote is not None else [])]:
            try:
                step()
            except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - reported, the sweep follows
                interrupted = interrupted or isinstance(exc, KeyboardInterrupt)
                print(f"fuzz: lane {index}: clean-up: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        reaper.sweep(run)
    return 130 if interrupted else 0


# -- the dispatcher --------------------------------------------------------------------------------


class Lane:
    """A lane process seen from the dispatcher: the seed it runs, its outcomes as they come."""

    def __init__(self, index: int, lanes: int, work: Path) -> None:
        self.index = index
        work.mkdir()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--lane", str(index), str(lanes), str(work)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.seed: int | None = None
        self.buffer = b""
        self.ended = False

    def give(self, seed: int | None) -> None:
        """Hand the lane its next seed; None: there is none left, it ends once its sequence did."""
        self.seed = seed
        try:
            if seed is None:
                self.stdin.close()
            else:
                self.stdin.write(f"{seed}\n".encode())
                self.stdin.flush()
        except (OSError, ValueError):
            pass  # the lane is gone (its end of output says so), or has its last seed already

    def outcomes(self) -> list[dict[str, Any]]:
        """The outcomes whose lines are complete (call when its output is readable); ``ended`` at its end."""
        data = os.read(self.stdout.fileno(), 1 << 16)
        if not data:
            self.ended = True
        *lines, self.buffer = (self.buffer + data).split(b"\n")
        return [json.loads(line) for line in lines]


def dispatch() -> int:
    sequences = int(os.environ.get("FUZZ_SEQUENCES", "1000"))
    base = int(os.environ["FUZZ_SEED"]) if os.environ.get("FUZZ_SEED") else random.randrange(10**9)
    jobs = max(1, min(int(os.environ.get("FUZZ_JOBS") or DEFAULT_JOBS), sequences))
    print(f"fuzz: {sequences} process sequences from seed {base} in {jobs} lanes", flush=True)
    warm_bytecode()
    run = reaper.new_run()  # the lanes carry it: if this process is killed, its watchdog kills them
    reaper.start_watchdog(run)
    work = Path(tempfile.mkdtemp(prefix="ng-ckpt-fuzz-"))
    seeds = iter(range(base, base + sequences))
    lanes: list[Lane] = []
    selector = selectors.DefaultSelector()
    violations = ran = 0
    interrupted = failed = False
    started = time.monotonic()

    def read(lane: Lane, more: bool) -> None:
        nonlocal ran, violations, failed
        for outcome in lane.outcomes():
            ran += 1
            verdict = "ok" if outcome["report"] is None else "VIOLATION"
            print(
                f"sequence {ran}/{sequences} {outcome['name']} seed={outcome['seed']} "
                f"{outcome['seconds']:.1f}s {verdict}",
                flush=True,
            )
            if outcome["report"] is not None:
                violations += 1
                print(outcome["report"], flush=True)
            lane.give(next(seeds, None) if more else None)
        if lane.ended:
            selector.unregister(lane.stdout)
            code = lane.proc.wait()
            if lane.seed is not None and not interrupted:
                failed = True
                print(f"fuzz: lane {lane.index} ended (status {code}) in seed {lane.seed}", flush=True)

    try:
        try:
            for index in range(jobs):
                lanes.append(Lane(index, jobs, work / f"lane{index}"))
                selector.register(lanes[-1].stdout, selectors.EVENT_READ, lanes[-1])
                lanes[-1].give(next(seeds, None))
            while selector.get_map():
                for key, _ in selector.select():
                    read(key.data, more=True)
        except KeyboardInterrupt:
            interrupted = True
            print("fuzz: interrupted", flush=True)
            # No more seeds. A lane the signal reached is cleaning up; one it did not (a SIGINT to this
            # process alone) ends after its sequence, or is interrupted in turn if that takes too long.
            for lane in lanes:
                if not lane.ended:
                    lane.give(None)
            try:
                for wait, then in ((_END_SECONDS, signal.SIGINT), (_CLEANUP_SECONDS, signal.SIGKILL)):
                    deadline = time.monotonic() + wait
                    while selector.get_map() and time.monotonic() < deadline:
                        for key, _ in selector.select(timeout=max(0.0, deadline - time.monotonic())):
                            read(key.data, more=False)
                    for lane in lanes:
                        if not lane.ended:
                            lane.proc.send_signal(then)
            except KeyboardInterrupt:
                pass  # interrupted again: no more waiting, every lane is killed below
    finally:
        try:
            for lane in lanes:
                if lane.proc.poll() is None:
                    lane.proc.kill()
                    lane.proc.wait()
            reaper.sweep(run)
        except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - reported; the lanes' watchdogs sweep
            interrupted = interrupted or isinstance(exc, KeyboardInterrupt)
            print(f"fuzz: clean-up: {type(exc).__name__}: {exc}", flush=True)
        finally:
            elapsed = time.monotonic() - started
            rate = ran / elapsed * 60 if elapsed else 0.0
            print(f"fuzz: {elapsed:.0f}s, {rate:.1f} sequences a minute in {jobs} lanes, work in {work}", flush=True)
            print(f"fuzz: {ran} sequences, {violations} violations", flush=True)
    if violations or failed:
        return 1
    return 130 if interrupted else 0


def main() -> int:
    if sys.argv[1:2] == ["--lane"]:
        return run_lane(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
    return dispatch()


if __name__ == "__main__":
    sys.exit(main())
