"""``benchmarks/process_stats.py``'s ``with_children``: a server's uvicorn workers counted beside its supervisor.

A real parent process that starts a real child (each blocked reading its stdin, so both stay alive
until the test closes it); no process is mocked.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "process_stats.py"
_spec = importlib.util.spec_from_file_location("process_stats_benchmark", _SCRIPT)
assert _spec is not None and _spec.loader is not None
process_stats = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(process_stats)

# The parent starts one child sharing its stdin, prints the child's pid, then waits for it.
_PARENT = (
    "import subprocess, sys; "
    "child = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()']); "
    "print(child.pid, flush=True); child.wait()"
)


def test_every_live_child_of_a_server_is_named_after_it_and_the_server_keeps_its_name() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        found = process_stats.with_children({"model": parent.pid})
        assert found == {"model": parent.pid, f"model/{child}": child}
        # A pid above the kernel's pid_max is no process: it contributes no child (and raises nothing).
        gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
        assert process_stats.with_children({"gone": gone}) == {"gone": gone}
    finally:
        assert parent.stdin is not None and parent.stdout is not None
        parent.stdin.close()
        parent.wait(30)
        parent.stdout.close()
