"""Process-level harness: a real Gym deployment from the nemo-gym wheel, plus the fake backend's controls.

``pytest_plugin`` offers it as fixtures (``gym_deployment``, ``gym_deployment_factory``);
this module needs no pytest. HTTP goes through aiohttp (a runtime dependency), straight to
127.0.0.1 (``trust_env`` off, so no proxy from the environment sees it); a failed call
raises ``aiohttp.ClientError`` (``ClientResponseError`` for a non-2xx reply).

Each server leads its own process group (``own_process_groups=True``), so ``crash()``
SIGKILLs whole groups and ``restart()`` starts fresh processes with the same config
and ports. Waiting is always on a condition with a deadline (``wait_until``,
``FakeBackend.wait_for``), never a bare sleep.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp

from .deployment import BACKEND, ENVIRONMENT, TOKEN_ENV, Deployment, free_port_base, port_span, rollout_body

__all__ = [
    "FakeBackend",
    "GymHarness",
    "children_of",
    "HARNESS_TOKEN",
    "free_port_base",
    "new_deployment",
    "pid_alive",
    "processes_in_groups",
    "send_rollout",
    "send_wave",
    "wait_until",
    "wait_until_async",
]

_POLL_SECONDS = 0.05
# The control token every harness deployment's servers read from ``TOKEN_ENV`` (unless the caller sets one).
HARNESS_TOKEN = "gym-harness-token"


def wait_until[T](predicate: Callable[[], T], timeout: float, what: str) -> T:
    """Poll ``predicate`` until it returns something truthy; ``AssertionError`` naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(_POLL_SECONDS)  # wait-ok: poll interval of a bounded wait on a condition


async def wait_until_async[T](predicate: Callable[[], Awaitable[T]], timeout: float, what: str) -> T:
    """``wait_until`` for an async predicate, yielding to the event loop between polls."""
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(_POLL_SECONDS)  # wait-ok: poll interval of a bounded wait on a condition


def processes_in_groups(pgids: Iterable[int]) -> list[int]:
    """Pids of every live (non-zombie) process whose process group is one of ``pgids``, from /proc."""
    wanted = set(pgids)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state, ppid, pgrp, ...
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[2]) in wanted:
            found.append(int(entry.name))
    return found


def children_of(pid: int) -> list[int]:
    """Pids of the live processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _client(timeout: float) -> aiohttp.ClientSession:
    # trust_env stays False: traffic goes to 127.0.0.1 directly, never through a proxy from the environment.
    # Each connect and each wait for bytes is bounded by ``timeout``; a held call's reply may take longer.
    limits = aiohttp.ClientTimeout(total=None, connect=timeout, sock_read=timeout)
    return aiohttp.ClientSession(timeout=limits, raise_for_status=True)


async def _json(session: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> Any:
    async with session.request(method, url, json=body) as reply:
        return await reply.json()


class FakeBackend:
    """Async client of the fake backend's control routes (``/_fake/...``)."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        async with _client(10.0) as client:
            return await _json(client, method, self.url + path, body)

    async def hold(self, match: str = "", count: int = 1, step: int | None = None) -> int:
        """Hold the next ``count`` calls whose conversation contains ``match`` (at ``step`` when given)."""
        return (await self._call("POST", "/_fake/hold", {"match": match, "count": count, "step": step}))["rule_id"]

    async def release(self, match: str | None = None) -> dict[str, int]:
        return await self._call("POST", "/_fake/release", {"match": match})

    async def stats(self) -> dict[str, Any]:
        return await self._call("GET", "/_fake/stats")

    async def delay(self, seconds: float) -> None:
        """Make every later call generate for ``seconds`` before it answers (0: answer at once)."""
        await self._call("POST", "/_fake/delay", {"seconds": seconds})

    async def reset(self) -> None:
        await self._call("POST", "/_fake/reset")

    async def rate(self, tokens_per_second: float) -> None:
        """Generate every later token at this rate (0: as fast as the backend goes)."""
        await self._call("POST", "/_fake/rate", {"tokens_per_second": tokens_per_second})

    async def pause_at(self, match: str, tokens: int) -> None:
        """Pause the backend (as ``/pause?mode=keep``) once a conversation containing ``match`` generated ``tokens``."""
        await self._call("POST", "/_fake/pause_at", {"match": match, "tokens": tokens})

    async def generated(self) -> dict[str, Any]:
        """``{"generated_total", "generated": {conversation: tokens}, "paused"}``: what the backend generated."""
        return await self._call("GET", "/_fake/generated")

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        """Poll stats until ``predicate(stats)``; returns those stats."""

        async def check() -> dict[str, Any] | None:
            stats = await self.stats()
            return stats if predicate(stats) else None

        stats = await wait_until_async(check, timeout, what)
        assert stats is not None  # wait_until_async returns only a value that is true
        return stats


async def send_rollout(env_url: str, rollout_id: str, *, timeout: float = 120.0, **body: Any) -> dict[str, Any]:
    """POST one episode to ``single_agent_turn``'s ``/run`` as Gym's rollout collection does; its JSON reply."""
    async with _client(timeout) as client:
        return await _json(client, "POST", env_url + "/run", rollout_body(rollout_id, **body))


async def send_wave(env_url: str, rollout_ids: Iterable[str], *, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Send every rollout at once over one connection pool; replies in the order of ``rollout_ids``."""
    async with _client(timeout) as client:

        async def one(rollout_id: str) -> dict[str, Any]:
            return await _json(client, "POST", env_url + "/run", rollout_body(rollout_id))

        return list(await asyncio.gather(*(one(r) for r in rollout_ids)))


class GymHarness:
    """A started ``Deployment`` with its fake backend client and crash helpers."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.fake = FakeBackend(deployment.urls[BACKEND])

    @property
    def urls(self) -> dict[str, str]:
        return self.deployment.urls

    @property
    def env_url(self) -> str:
        return self.deployment.urls[ENVIRONMENT]

    def crash(self) -> dict[str, int]:
        """SIGKILL every process group; returns the ``{name: pgid}`` that were killed."""
        groups = self.deployment.process_groups
        self.deployment.kill()
        return groups

    def restart(self, timeout: float = 120.0) -> None:
        """Start fresh processes with the same config and ports (after ``crash`` or ``stop``)."""
        self.deployment.start(timeout=timeout)

    def stop(self) -> None:
        self.deployment.stop()


def new_deployment(work_dir: Path, **kwargs: Any) -> Deployment:
    """A ``Deployment`` on free ports with every child in its own process group, not started.

    Defaults: logs in ``<work_dir>/logs``, ``HARNESS_TOKEN`` as the control token; every
    other keyword goes to ``Deployment`` (``checkpoint=``, ``entrypoints=``...).
    """
    kwargs.setdefault("log_dir", work_dir / "logs")
    kwargs.setdefault("extra_env", {TOKEN_ENV: HARNESS_TOKEN})
    # Every port of every replica free, not only the first chain's.
    base = free_port_base(port_span(kwargs.get("replicas", 1)))
    return Deployment(base, work_dir, own_process_groups=True, **kwargs)


def pid_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
