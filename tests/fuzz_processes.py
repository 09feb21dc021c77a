"""``make fuzz``'s real-process part: random sequences of the two process machines, one per seed.

``python tests/fuzz_processes.py`` runs ``FUZZ_SEQUENCES`` sequences (default 1,000) of
``deployment_machine.DeploymentMachine`` (three in four) and ``collect_machine.CollectMachine`` (the
fourth) on one deployment each, forked from a zygote like the test suite's, with seeds ``FUZZ_SEED``,
``FUZZ_SEED + 1``, ... (a random start when unset, printed). Every violation is printed with its seed and
its steps; ``FUZZ_SEED=<seed> FUZZ_SEQUENCES=1 make fuzz`` replays it (the same rules and arguments; the
processes' timing may differ). ``FUZZ_STEPS`` bounds a deployment sequence (default 18). The last line is
exactly ``fuzz: N sequences, K violations`` (also after Ctrl-C); the exit status is 1 when K > 0, 130 when interrupted.
"""

from __future__ import annotations

import compileall
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from collect_machine import CollectMachine, new_collect_deployment  # noqa: E402
from deployment_machine import VERIFY_SERVER, DeploymentMachine, new_machine_deployment  # noqa: E402
from seeded_machines import run_seeded  # noqa: E402

import nemo_gym_checkpoint_plugin  # noqa: E402
from nemo_gym_checkpoint_plugin.testing import reaper  # noqa: E402
from nemo_gym_checkpoint_plugin.testing.deployment import Deployment, use_zygote  # noqa: E402
from nemo_gym_checkpoint_plugin.testing.zygote import Zygote  # noqa: E402

COLLECT_STEPS = 6


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


def main() -> int:
    sequences = int(os.environ.get("FUZZ_SEQUENCES", "1000"))
    base = int(os.environ["FUZZ_SEED"]) if os.environ.get("FUZZ_SEED") else random.randrange(10**9)
    steps = int(os.environ.get("FUZZ_STEPS", "18"))
    print(f"fuzz: {sequences} process sequences from seed {base}", flush=True)
    warm_bytecode()
    run = reaper.new_run()
    reaper.start_watchdog(run)
    zygote = Zygote()
    use_zygote(lambda: zygote)
    work = Path(tempfile.mkdtemp(prefix="ng-ckpt-fuzz-"))
    deployments: dict[str, Deployment] = {}
    violations = ran = 0
    interrupted = False
    started = time.monotonic()
    try:
        for seed in range(base, base + sequences):
            name = machine_of(seed)
            if name not in deployments:
                make = new_machine_deployment if name == "deployment" else new_collect_deployment
                deployments[name] = make(work / f"{name}-servers")
                deployments[name].start(timeout=240)
                machine = DeploymentMachine if name == "deployment" else CollectMachine
                machine.deployment, machine.work = deployments[name], work / name
                machine.work.mkdir()
            machine_class = DeploymentMachine if name == "deployment" else CollectMachine
            outcome = run_seeded(machine_class, seed, steps if name == "deployment" else COLLECT_STEPS)
            ran += 1
            verdict = "ok" if outcome.violation is None else "VIOLATION"
            print(f"sequence {ran}/{sequences} {name} seed={seed} {outcome.seconds:.1f}s {verdict}", flush=True)
            if outcome.violation is not None:
                violations += 1
                print(outcome.report(name), flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("fuzz: interrupted", flush=True)
    finally:
        # Ctrl-C (or `timeout -s INT`) reaches the whole process group, the zygote too, so a stop can be
        # interrupted again: each clean-up step is tried on its own, the reaper sweeps what is left, and
        # the last line is printed whatever happened.
        try:
            for step in [*(d.stop for d in deployments.values()), lambda: use_zygote(None), zygote.close]:
                try:
                    step()
                except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - reported, the sweep follows
                    interrupted = interrupted or isinstance(exc, KeyboardInterrupt)
                    print(f"fuzz: clean-up: {type(exc).__name__}: {exc}", flush=True)
            reaper.sweep(run)
        finally:
            print(f"fuzz: {time.monotonic() - started:.0f}s, work in {work}", flush=True)
            print(f"fuzz: {ran} sequences, {violations} violations", flush=True)
    if violations:
        return 1
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
