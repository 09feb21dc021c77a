"""What the servers of a running deployment use, read from ``/proc``: memory, descriptors, CPU, the network's losses.

A sibling of ``scale.py`` (not a package): each reader takes ``{server name: pid}`` and skips a
process that is gone.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

# Clock ticks per second of /proc/<pid>/stat's utime and stime.
_TICKS = os.sysconf("SC_CLK_TCK")


def with_children(pids: dict[str, int]) -> dict[str, int]:
    """``pids`` and every live child of each (a server's uvicorn workers: ``"<name>/<child pid>"``).

    A server with ``num_workers > 1`` serves from its workers, which uvicorn's supervisor (the pid the
    deployment started) spawned: their memory, descriptors and CPU are theirs, not the supervisor's.
    """
    found = dict(pids)
    for name, pid in pids.items():
        children: set[int] = set()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    children.update(int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split())
        for child in sorted(children):
            found[f"{name}/{child}"] = child
    return found


def peak_rss_mb(pids: dict[str, int]) -> dict[str, float]:
    """Peak resident memory (VmHWM) of each live process, in MiB."""
    peaks = {}
    for name, pid in pids.items():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                peaks[name] = round(int(line.split()[1]) / 1024, 1)
    return peaks


def open_fds(pids: dict[str, int]) -> dict[str, int]:
    """Open file descriptors of each live process and of this controller, now."""
    counts = {"controller": len(os.listdir("/proc/self/fd"))}
    for name, pid in pids.items():
        with contextlib.suppress(OSError):
            counts[name] = len(os.listdir(f"/proc/{pid}/fd"))
    return counts


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system, every thread) each live process has used so far, and this controller's."""
    used = {"controller": sum(os.times()[:2])}
    for name, pid in pids.items():
        try:
            # Fields after the command (which may hold spaces) start at state; utime and stime are 14 and 15.
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        used[name] = (int(fields[11]) + int(fields[12])) / _TICKS
    return used


@contextlib.contextmanager
def cpu_used(pids: dict[str, int], into: dict[str, float]) -> Iterator[None]:
    """Fill ``into`` with the CPU seconds each process (and this controller) used while the block ran."""
    before = cpu_seconds(pids)
    try:
        yield
    finally:
        after = cpu_seconds(pids)
        into.update({name: round(after[name] - before[name], 3) for name in after if name in before})
        into["total"] = round(sum(v for k, v in into.items() if k != "total"), 3)


def listen_overflows() -> int | None:
    """The kernel's count of connections dropped because a listen queue was full (this network namespace)."""
    try:
        return _snmp("/proc/net/netstat", "TcpExt:")["ListenOverflows"]
    except (OSError, IndexError, KeyError, ValueError):
        return None


def _snmp(path: str, section: str) -> dict[str, int]:
    """One section (``Tcp:``, ``TcpExt:``) of ``/proc/net/snmp`` or ``/proc/net/netstat``: name -> value."""
    lines = [line.split() for line in Path(path).read_text().splitlines() if line.startswith(section)]
    return {name: int(value) for name, value in zip(lines[0][1:], lines[1][1:], strict=True)}


def net_counters() -> dict[str, int] | None:
    """The kernel's packet-loss counters, since boot (this network namespace; softnet: the whole host).

    ``softnet_dropped``: packets dropped because a CPU's input queue (``net.core.netdev_max_backlog``)
    was full; loopback traffic goes through it too. ``retransmitted_segments``, ``retransmit_timeouts``
    and ``syn_retransmits``: TCP sending again what was lost (a lost segment waits for a timeout
    that doubles on each loss: 0.2 s, 0.4 s, ... minutes).
    """
    try:
        # One line per CPU; the second column (hex) counts drops.
        dropped = sum(int(line.split()[1], 16) for line in Path("/proc/net/softnet_stat").read_text().splitlines())
        tcp, ext = _snmp("/proc/net/snmp", "Tcp:"), _snmp("/proc/net/netstat", "TcpExt:")
        return {
            "softnet_dropped": dropped,
            "retransmitted_segments": tcp["RetransSegs"],
            "retransmit_timeouts": ext["TCPTimeouts"],
            "syn_retransmits": ext["TCPSynRetrans"],
        }
    except (OSError, IndexError, KeyError, ValueError):
        return None


def counters_since(before: dict[str, int] | None) -> dict[str, int] | None:
    """``net_counters()`` now minus ``before`` (None where either could not be read)."""
    after = net_counters()
    if before is None or after is None:
        return None
    return {name: after[name] - before[name] for name in after}


def bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
