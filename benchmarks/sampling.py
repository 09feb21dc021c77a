"""Sample live server processes with py-spy while one phase of a benchmark runs, and summarize where the time went.

``py-spy`` is not a dependency of the project: ``--profile`` needs it on PATH (or beside the
interpreter, ``pip install py-spy``). Each phase writes, per server, the collapsed stacks py-spy
records (``<phase>-<server>.txt``) and a summary of the functions with the most samples, inclusive
and self, so that a figure above its target comes with the profile that explains it.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path


def py_spy() -> str:
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    return found


@contextlib.contextmanager
def sampled(pids: dict[str, int], out_dir: Path, phase: str, rate: int = 1000) -> Iterator[None]:
    """Record every process in ``pids`` while the block runs; stop the recorders after it, and wait for their files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    recorders = {
        name: subprocess.Popen(
            [
                py_spy(),
                "record",
                "--pid",
                str(pid),
                "--rate",
                str(rate),
                "--format",
                "raw",
                "--nonblocking",
                "--function",
                "--output",
                str(out_dir / f"{phase}-{name}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, pid in pids.items()
    }
    try:
        yield
    finally:
        for recorder in recorders.values():
            recorder.send_signal(signal.SIGINT)
        for recorder in recorders.values():
            try:
                recorder.wait(timeout=60)
            except subprocess.TimeoutExpired:
                recorder.kill()


def _frames(line: str) -> tuple[list[str], int]:
    stack, _, count = line.rpartition(" ")
    return stack.split(";"), int(count)


def summarize(raw: Path, top: int = 12, idle: tuple[str, ...] = ("select (selectors.py", "epoll")) -> str:
    """The functions with most samples in one collapsed-stacks file: inclusive (any frame) and self (innermost)."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = busy = 0
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        frames, count = _frames(line)
        total += count
        if any(marker in frames[-1] for marker in idle):
            continue
        busy += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    if not total:
        return f"{raw.name}: no samples\n"
    lines = [f"{raw.name}: {total} samples, {busy} busy ({100 * busy / total:.0f}%)"]
    lines.append("  inclusive:")
    lines += [f"    {100 * n / total:5.1f}%  {frame}" for frame, n in inclusive.most_common(top)]
    lines.append("  self:")
    lines += [f"    {100 * n / total:5.1f}%  {frame}" for frame, n in own.most_common(top)]
    return "\n".join(lines) + "\n"


def write_summaries(out_dir: Path, phase: str) -> Path:
    summary = out_dir / f"{phase}-summary.txt"
    summary.write_text("".join(summarize(raw) for raw in sorted(out_dir.glob(f"{phase}-*.txt")) if raw != summary))
    return summary
