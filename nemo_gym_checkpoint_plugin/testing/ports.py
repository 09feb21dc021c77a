"""Ports for the testing kit's deployments on 127.0.0.1: free ones, and a checked ``PORT_BASE``."""

from __future__ import annotations

import random
import socket

from .gym_config import HOST, PORT_SPAN

__all__ = ["PORT_RANGE", "free_port_base", "parse_port_base", "port_is_free"]

# Where ``free_port_base`` draws from: below the kernel's ephemeral range (32768+), so outgoing connections
# never take a server's port. Processes that start deployments side by side can give each one its own slice
# (``make fuzz``'s lanes do), so two of them never draw the same ports between a check and a bind.
PORT_RANGE: tuple[int, int] = (20000, 32000)


def port_is_free(port: int) -> bool:
    """True when ``port`` on 127.0.0.1 can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # The servers bind with SO_REUSEADDR too, so a port in TIME_WAIT after a crash counts as free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
    return True


def parse_port_base(raw: str) -> int:
    """A ``PORT_BASE`` value checked; ``ValueError`` naming the variable when it is unusable."""
    try:
        base = int(raw)
    except ValueError:
        raise ValueError(f"PORT_BASE must be an integer, got {raw!r}") from None
    if not 1024 <= base <= 65535 - PORT_SPAN:
        raise ValueError(f"PORT_BASE must be between 1024 and {65535 - PORT_SPAN}, got {base}")
    return base


def free_port_base(span: int = PORT_SPAN, tries: int = 200) -> int:
    """A random base port whose ``span`` consecutive ports on 127.0.0.1 are free now."""
    rng = random.Random()
    low, high = PORT_RANGE
    for _ in range(tries):
        base = rng.randrange(low, high - span)
        if all(port_is_free(base + offset) for offset in range(span)):
            return base
    raise RuntimeError(f"no {span} consecutive free ports found in {tries} tries")
