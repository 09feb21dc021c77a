"""The coordinator's roster: which workers registered, which left, and what that means for a checkpoint.

A server runs ``expected`` workers (its ``num_workers``). Each connects a link to the
coordinator and registers (op ``register``, body ``{"pid": <its pid>}``); the reply hands it the
server's current state (``snapshot``: retired marks, whether admission is closed and for which
checkpoint), so a worker that registers late (a replacement uvicorn started after a crash)
starts with the marks every other worker has.

Rules the coordinator builds on (docs/protocol.md, "Several workers"):

- a worker that has not registered blocks readiness: the roster's readiness names one blocker
  per missing worker; it never counts as ready;
- a worker that disconnects while a checkpoint is active is lost *for that checkpoint*: it blocks
  the checkpoint's readiness for good, even once a replacement registered (the replacement never
  saw the admission close), and ``lost_during`` names it so a commit can fail ``export_failed``;
- any worker that ever left makes ``left`` non-empty: the coordinator refuses a restore then,
  since what the dead worker held (sessions, running episodes) may still be referred to.

Blockers of the roster are not capture keys: they start with ``worker `` and name the worker
(``worker 4242 disconnected during step-3``) or the shortfall (``worker not registered (3 of 4)``),
so they are ``Readiness.worker_blockers``, never ``blockers`` (which stay capture keys).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nemo_gym_checkpoint_plugin._types import Readiness

from .link import Link

__all__ = ["REGISTER_OP", "Roster", "WorkerAnswers", "worker_name"]

REGISTER_OP = "register"


def worker_name(pid: int) -> str:
    return f"worker {pid}"


@dataclass
class WorkerAnswers:
    """What each worker answered one broadcast: replies by worker name, and the workers that failed."""

    replies: dict[str, Any] = field(default_factory=dict)
    failures: dict[str, Exception] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.failures


class Roster:
    """The workers of one server, as the coordinator sees them. Use from the coordinator's event loop."""

    def __init__(self, expected: int, snapshot: Callable[[], Mapping[str, Any]] | None = None) -> None:
        if expected < 1:
            raise ValueError(f"a server runs at least one worker, not {expected}")
        self.expected = expected
        self._snapshot = snapshot or dict
        self._connected: dict[str, Link] = {}
        self._left: list[str] = []
        self._active: str | None = None
        self._lost_during: dict[str, list[str]] = {}
        self._changed = asyncio.Event()

    # -- membership ------------------------------------------------------------------------------

    @property
    def connected(self) -> tuple[str, ...]:
        return tuple(sorted(self._connected))

    def links(self) -> dict[str, Link]:
        """The connected workers' links by worker name (a copy)."""
        return dict(self._connected)

    @property
    def left(self) -> tuple[str, ...]:
        """Every worker that disconnected since the server started, in the order they left."""
        return tuple(self._left)

    def register(self, link: Link, body: Any) -> dict[str, Any]:
        """Answer a worker's ``register`` call: record it, reply the current state (``snapshot``).

        A body without a positive integer ``pid``, or a pid already connected, is refused with
        ``ValueError`` (the link answers it as a remote error; the worker exits).
        """
        pid = body.get("pid") if isinstance(body, Mapping) else None
        if type(pid) is not int or pid <= 0:
            raise ValueError(f"register needs a positive integer pid, not {body!r:.80}")
        name = worker_name(pid)
        if name in self._connected:
            raise ValueError(f"{name} is already registered")
        link.name = name
        self._connected[name] = link
        link.on_close(lambda closed: self._leave(name, closed))
        self._changed.set()
        return {"worker": name, **self._snapshot()}

    def _leave(self, name: str, link: Link) -> None:
        if self._connected.get(name) is not link:
            return
        del self._connected[name]
        self._left.append(name)
        if self._active is not None:
            self._lost_during.setdefault(self._active, []).append(name)
        self._changed.set()

    # -- checkpoints -----------------------------------------------------------------------------

    def begin(self, checkpoint_id: str) -> None:
        """A checkpoint (or restore) ``checkpoint_id`` is active: a worker leaving now is lost for it."""
        self._active = checkpoint_id

    def end(self, checkpoint_id: str) -> None:
        if self._active == checkpoint_id:
            self._active = None
        self._lost_during.pop(checkpoint_id, None)

    def lost_during(self, checkpoint_id: str) -> tuple[str, ...]:
        return tuple(self._lost_during.get(checkpoint_id, ()))

    def readiness(self, checkpoint_id: str | None) -> Readiness:
        """What the roster itself blocks: workers lost during ``checkpoint_id``, and workers not registered."""
        blockers = [f"{name} disconnected during {checkpoint_id}" for name in self.lost_during(checkpoint_id or "")]
        missing = self.expected - len(self._connected)
        blockers.extend(
            f"worker not registered ({len(self._connected)} of {self.expected}), #{index}"
            for index in range(1, missing + 1)
        )
        return Readiness(worker_blockers=blockers, counts={"workers": len(self._connected)})

    async def changed(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until a worker registers or leaves; whether one did."""
        self._changed.clear()
        try:
            async with asyncio.timeout(timeout):
                await self._changed.wait()
        except TimeoutError:
            return False
        return True

    # -- calls -----------------------------------------------------------------------------------

    async def broadcast(self, op: str, body: Any, *, timeout: float) -> WorkerAnswers:
        """Call ``op`` on every connected worker at once; each worker's reply or typed failure.

        Never raises for a worker: a worker that does not answer within ``timeout``, disconnects or
        refuses is in ``failures`` (a ``LinkError`` or the refusal it sent), the others in ``replies``.
        """
        links = dict(self._connected)
        results = await asyncio.gather(
            *(link.call(op, body, timeout=timeout) for link in links.values()), return_exceptions=True
        )
        answers = WorkerAnswers()
        for name, result in zip(links, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result  # cancellation and the like are not a worker's answer
                answers.failures[name] = result
            else:
                answers.replies[name] = result
        return answers

    async def aclose(self) -> None:
        await asyncio.gather(*(link.aclose() for link in list(self._connected.values())))
