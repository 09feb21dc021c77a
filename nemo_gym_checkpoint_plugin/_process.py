"""Whether a process still exists on this host: one answer for leases, spools, locks and runtime dirs."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """False only when no process ``pid`` exists here (a process of another user counts as alive)."""
    if pid <= 0:
        return False  # never a server's pid; kill() would signal a process group instead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True
