"""Before and after in the same run: each participant's commit and restore CPU, this tree against a git ref.

Runs ``benchmarks/control_routes.py`` (one real Gym server in process, its commit and restore sent
through its real control routes at the scale benchmark's 16,000 shape; CPU seconds by
``time.process_time``), or with ``--hooks`` ``benchmarks/participants.py`` (the participant's own
hooks called directly, ``--episodes`` of them: export, install and the rest), once per kind per
round for the baseline and once for this tree, alternately,
so that both see the same load on a shared machine; keeps each phase's best over the rounds. The
baseline is ``git archive <ref>`` of this repository laid out as the installed package (the
``builtin_participants`` and ``hookspecs`` directories inside ``nemo_gym_checkpoint_plugin``) and put
first on ``PYTHONPATH``, so the same script and the same venv import the baseline's code instead.

    .venv/bin/python benchmarks/cost_ab.py [--baseline main] [--kinds agent,environment,resources,model]
        [--rounds 3] [--token-capture] [--second] | --hooks [--episodes 8000] | --storage]

``--second`` passes ``--second`` to ``control_routes.py``: each run also commits a second
checkpoint, nothing changed, into a sibling directory (phase ``second_commit``).

With ``--storage``, ``benchmarks/storage_cost.py`` instead (the storage benchmark's 1,000 x 350 KB
commit and restore through the built-in backend, and their floors, wall and CPU seconds), once per
round for each side, alternately.

Prints per kind and phase the baseline's and this tree's CPU seconds, microseconds per episode and
the saving; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PHASES = ("commit_s", "restore_s")
HOOKS = ("export", "retire", "install", "restored_pending", "delete_restored", "retire_live")
# Directories the package maps in from the repository's top level (pyproject's package-dir).
MAPPED = ("builtin_participants", "hookspecs")


def baseline_tree(ref: str, into: Path) -> Path:
    """The package of ``ref`` laid out for import from ``into`` (returned: the PYTHONPATH entry)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    source = into / "source"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(source, filter="data")
    package = into / "path" / "nemo_gym_checkpoint_plugin"
    shutil.copytree(source / "nemo_gym_checkpoint_plugin", package)
    for name in MAPPED:
        shutil.copytree(source / name, package / name)
    return into / "path"


def one(
    kind: str, python_path: str | None, token_capture: bool, hooks: int | None = None, second: bool = False
) -> dict[str, Any]:
    """One run of the kind (``hooks``: participants.py with that many episodes), its figures by phase."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if python_path is not None:
        env["PYTHONPATH"] = python_path
    if hooks is not None:
        command = [sys.executable, str(HERE / "participants.py"), "--kinds", kind, "--episodes", str(hooks)]
    else:
        command = [sys.executable, str(HERE / "control_routes.py"), "--kinds", kind]
        if token_capture:
            command.append("--token-capture")
        if second:
            command.append("--second")
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} ({'baseline' if python_path else 'this tree'}): {done.stderr[-2000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    if hooks is not None:
        return {"episodes": hooks, **{hook: figures["kinds"][kind][hook] for hook in HOOKS}}
    return figures[kind]


def storage_run(python_path: str | None) -> dict[str, float]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if python_path is not None:
        env["PYTHONPATH"] = python_path
    done = subprocess.run(
        [sys.executable, str(HERE / "storage_cost.py")], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"storage ({'baseline' if python_path else 'this tree'}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def storage_ab(baseline: str, rounds: int) -> None:
    """Storage commit and restore, this tree against ``baseline``, rounds alternating which runs first."""
    best: dict[str, dict[str, float]] = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory(prefix="cost-ab-") as directory:
        base_path = str(baseline_tree(baseline, Path(directory)))
        for round_ in range(max(1, rounds)):
            order = [("before", base_path), ("after", None)]
            for side, path in order if round_ % 2 == 0 else order[::-1]:
                run = storage_run(path)
                for key, value in run.items():
                    best[side][key] = min(value, best[side].get(key, value))
    for side in ("before", "after"):
        figures = best[side]
        print(
            f"{side:<7} commit {figures['commit_s']:.3f} s (cpu {figures['commit_cpu_s']:.3f}) = "
            f"{figures['commit_s'] / figures['floor_commit_durable_s']:.2f}x durable floor; "
            f"restore {figures['restore_s']:.3f} s (cpu {figures['restore_cpu_s']:.3f}) = "
            f"{figures['restore_s'] / figures['floor_restore_s']:.2f}x read floor",
            flush=True,
        )
    print(json.dumps({"baseline": baseline, "rounds": rounds, "storage": True, **best}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="main", help="git ref of the code to compare against")
    parser.add_argument("--kinds", default="agent,environment,resources,model")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side per kind; each phase's best is kept")
    parser.add_argument("--token-capture", action="store_true", help="Gym's token capture on (the model's rows)")
    parser.add_argument("--second", action="store_true", help="also a second commit, nothing changed (incremental)")
    parser.add_argument("--hooks", action="store_true", help="the participant's hooks alone (participants.py)")
    parser.add_argument("--episodes", type=int, default=8000, help="episodes held with --hooks")
    parser.add_argument("--storage", action="store_true", help="the storage backend's commit and restore")
    args = parser.parse_args()
    if args.storage:
        storage_ab(args.baseline, args.rounds)
        return
    phases = HOOKS if args.hooks else (*PHASES, "second_commit_s") if args.second else PHASES
    best: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="cost-ab-") as directory:
        base_path = str(baseline_tree(args.baseline, Path(directory)))
        for kind in args.kinds.split(","):
            sides = best.setdefault(kind, {"before": {}, "after": {}})
            episodes = 0
            for round_ in range(max(1, args.rounds)):
                order = [("before", base_path), ("after", None)]
                # Which side runs first alternates: a run that leaves the disk or caches busy hits both alike.
                for side, path in order if round_ % 2 == 0 else order[::-1]:
                    run = one(kind, path, args.token_capture, args.episodes if args.hooks else None, args.second)
                    episodes = run["episodes"]
                    for phase in phases:
                        sides[side][phase] = min(run[phase], sides[side].get(phase, run[phase]))
            sides["episodes"] = episodes  # type: ignore[assignment]
            for phase in phases:
                before, after = sides["before"][phase], sides["after"][phase]
                print(
                    f"{kind:<12}{phase.removesuffix('_s'):<17} "
                    f"before {before:6.3f} s ({before / episodes * 1e6:6.1f} us/episode)"
                    f"  after {after:6.3f} s ({after / episodes * 1e6:6.1f} us/episode)"
                    f"  saved {before - after:+6.3f} s ({(before - after) / before * 100 if before else 0:+5.1f}%)",
                    flush=True,
                )
    summary = {
        "baseline": args.baseline,
        "rounds": args.rounds,
        "token_capture": args.token_capture,
        "second": args.second,
        "hooks": args.hooks,
    }
    print(json.dumps({**summary, **best}))


if __name__ == "__main__":
    main()
