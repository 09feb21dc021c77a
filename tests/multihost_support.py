"""Several "hosts" on one machine: network namespaces the test makes, joined by a bridge, each its own address.

``Lan`` makes a hub namespace holding a bridge (``10.<a>.<b>.1/24``, a subnet drawn at random:
nothing outside the test's namespaces ever sees it) and, per host, a namespace whose ``eth0`` is
one end of a veth pair whose other end is on the bridge (``10.<a>.<b>.<10 + i>``). Nothing is
added to the machine's own namespace: the hosts reach each other and the hub, and nothing else.
Processes start inside a namespace with ``ip netns exec``; ``processes(name)`` finds every process
whose network namespace is that one (all started by the test), and ``close`` SIGKILLs them and
deletes every namespace it made. Needs root and iproute2; ``lan_supported`` says whether they work.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import subprocess
from collections.abc import Sequence

__all__ = ["Lan", "lan_supported"]


def _ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def lan_supported() -> bool:
    """Whether this process may make named network namespaces with a bridge and veth pairs."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"ngc-probe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
        _ip("link", "add", "probe0", "type", "veth", "peer", "name", "probe1", netns=name)
        _ip("link", "add", "br-probe", "type", "bridge", netns=name)
        return True
    except (subprocess.SubprocessError, OSError):
        return False
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


class Lan:
    """A hub namespace with a bridge, and host namespaces on it; ``close()`` undoes everything."""

    def __init__(self, tag: str | None = None, prefix: str | None = None, *, attach: bool = False) -> None:
        """A new LAN; with ``attach``, the LAN ``tag``/``prefix`` another process made (to add hosts to it)."""
        self.tag = tag or secrets.token_hex(3)
        rng = random.Random()
        self.prefix = prefix or f"10.{rng.randrange(16, 250)}.{rng.randrange(1, 250)}"
        self.hub = f"ngc-{self.tag}-hub"
        self.hub_address = f"{self.prefix}.1"
        self.hosts: dict[str, str] = {}  # name -> namespace
        self.addresses: dict[str, str] = {}
        self._made: list[str] = []
        self._veths: dict[str, str] = {}
        if attach:
            return
        try:
            self._netns_add(self.hub)
            _ip("link", "set", "lo", "up", netns=self.hub)
            _ip("link", "add", "br0", "type", "bridge", netns=self.hub)
            _ip("addr", "add", f"{self.hub_address}/24", "dev", "br0", netns=self.hub)
            _ip("link", "set", "br0", "up", netns=self.hub)
        except BaseException:
            self.close()
            raise

    def _netns_add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def add_host(self, name: str, number: int) -> str:
        """A fresh host namespace on the bridge at ``<prefix>.<10 + number>``; returns its address."""
        namespace = f"ngc-{self.tag}-{name}"
        address = f"{self.prefix}.{10 + number}"
        self._netns_add(namespace)
        veth = f"v{self.tag[:4]}{number}"
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace, netns=self.hub)
        _ip("link", "set", veth, "master", "br0", "up", netns=self.hub)
        _ip("link", "set", "lo", "up", netns=namespace)
        _ip("addr", "add", f"{address}/24", "dev", "eth0", netns=namespace)
        _ip("link", "set", "eth0", "up", netns=namespace)
        self.hosts[name], self.addresses[name] = namespace, address
        self._veths[name] = veth
        return address

    def remove_host(self, name: str) -> None:
        """SIGKILL everything running on the host, then delete its namespace (its veth goes with it)."""
        namespace = self.hosts.pop(name)
        self.addresses.pop(name)
        self._kill(namespace)
        # The hub's end first: a deleted namespace's interfaces go in the kernel's own time, and a fresh
        # host on the same number needs the name now.
        subprocess.run(
            ["ip", "netns", "exec", self.hub, "ip", "link", "del", self._veths.pop(name)],
            capture_output=True,
            timeout=30,
        )
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        if namespace in self._made:
            self._made.remove(namespace)

    def argv(self, namespace: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", namespace, *argv]

    def processes(self, namespace: str) -> list[int]:
        """Pids of every process whose network namespace is ``namespace``."""
        try:
            inode = os.stat(f"/run/netns/{namespace}").st_ino
        except FileNotFoundError:
            return []
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    if os.stat(f"/proc/{entry}/ns/net").st_ino == inode:
                        found.append(int(entry))
                except OSError:
                    continue
        return found

    def _kill(self, namespace: str) -> None:
        for pid in self.processes(namespace):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue

    def namespaces(self) -> list[str]:
        """Every namespace of this LAN, whoever made it (``ngc-<tag>-*``)."""
        try:
            return sorted(n for n in os.listdir("/run/netns") if n.startswith(f"ngc-{self.tag}-"))
        except FileNotFoundError:
            return []

    def close(self) -> None:
        """SIGKILL every process in the LAN's namespaces, then delete them (the hub last)."""
        every = self.namespaces()
        for namespace in every:
            self._kill(namespace)
        for namespace in sorted(every, key=lambda n: n == self.hub):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        self._made.clear()
