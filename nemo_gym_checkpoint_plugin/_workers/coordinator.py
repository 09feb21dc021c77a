"""The coordinator in a server's main process: the workers' socket, their registration, restored records.

``Coordinator(expected)`` listens (``serve``) on a Unix socket in the runtime directory; each
worker connects and registers (``worker.py``). The main process's ``ControlPlane`` holds
``Coordinator.participant`` (``fanout.py``) as its one participant plugin, which fans every hook
out over the roster; ``bind`` hands the coordinator the plane's admission and marks, so that

- a worker registering gets the plane's marks and, while a checkpoint or restore is active,
  admission closed for it (``snapshot``);
- a worker that left, or reported its first data request (``served``), makes the plane refuse a
  restore before it marks anything (``Admission.restore_refusal`` / ``Admission.served``);
- a worker's ``claim`` of a replacement attempt gets the restored records the coordinator holds
  (``restored.py``), one owner each;
- each worker's readiness, as it pushes it (``readiness``), so the participant's ``ready`` never
  waits on a worker; a control request a worker forwards (``forward.py``) runs through
  ``control_app``, the plane's control routes; a resources session one worker closed is relayed
  to the others;
- the workers' admission gates for the plane's metrics (``watch_metrics``, ``gates.py``): asked for
  their figures before each scrape.

In a server, ``service.py`` runs it on its own event loop thread in Gym's main process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nemo_gym_checkpoint_plugin._admission import Admission, RetiredMarks

from . import messages as m
from .gates import WorkerGates
from .link import Link, serve
from .restored import RestoredRecords
from .roster import REGISTER_OP, Roster

if TYPE_CHECKING:
    from nemo_gym_checkpoint_plugin._telemetry.metrics import ServerMetrics

__all__ = ["Coordinator"]

logger = logging.getLogger(__name__)


class Coordinator:
    """The workers of one server, as its main process coordinates them. Use from one event loop.

    ``call_timeout`` bounds each quick call to a worker (admission, readiness, marks);
    ``work_timeout`` the calls that do a worker's work (export, retire, deleting restored state),
    which the plane bounds by the operation's deadline as well; ``poll_seconds`` how long one
    ``wait_ready`` round waits before readiness is asked again.
    """

    def __init__(
        self,
        expected: int,
        *,
        call_timeout: float = 10.0,
        work_timeout: float = 600.0,
        poll_seconds: float = 1.0,
        scrape_timeout: float = 2.0,
    ) -> None:
        from .fanout import WorkersParticipant

        self.roster = Roster(expected, snapshot=self.snapshot)
        # The workers' admission gates as one, for the plane's metrics (``watch_metrics``, gates.py).
        self.gates = WorkerGates()
        self.scrape_timeout = scrape_timeout
        self.restored = RestoredRecords()
        self.call_timeout = call_timeout
        self.work_timeout = work_timeout
        self.poll_seconds = poll_seconds
        self.participant = WorkersParticipant(self)
        # The checkpoint or restore admission is closed for (set by close_admission, cleared by open_admission).
        self.closed_for: str | None = None
        self._admission: Admission | None = None
        self._marks: RetiredMarks | None = None
        self._served = False
        self._server: asyncio.Server | None = None
        # Each connected worker's readiness as it last pushed it (``messages.READINESS``), by worker name.
        self.readiness: dict[str, dict[str, Any]] = {}
        self._readiness_changed = asyncio.Event()
        # The ASGI app of the plane's control routes: control requests the workers forward run through it.
        self.control_app: Any = None

    def bind(self, admission: Admission, marks: RetiredMarks) -> None:
        """The main process's plane state: its admission (restore refusals) and marks (snapshots)."""
        self._admission = admission
        self._marks = marks
        self._refresh_refusals()

    def watch_metrics(self, metrics: ServerMetrics) -> None:
        """The plane's metrics read the workers' gates, asked for before each scrape (``refresh_gates``)."""
        metrics.watch_workers(self.gates, self.refresh_gates)

    async def refresh_gates(self) -> None:
        """Ask every worker for its gate's figures; one that does not answer within ``scrape_timeout`` counts
        with what it answered last (a metrics scrape waits at most that long)."""
        answers = await self.roster.broadcast(m.GATE_FIGURES, None, timeout=self.scrape_timeout)
        for name in self.gates.update(answers.replies, self.roster.connected):
            logger.warning("%s answered its gate figures in a shape not understood here", name)
        for name, failure in sorted(answers.failures.items()):
            logger.info("%s did not answer its gate figures for the metrics (%s); its last are used", name, failure)

    async def serve(self, path: str) -> None:
        self._server = await serve(path, lambda _link: None, handler=self._handle)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        await self.roster.aclose()
        if self._server is not None:
            await self._server.wait_closed()

    def snapshot(self) -> dict[str, Any]:
        """What a registering worker starts with: every retired mark, the checkpoint admission is closed for,
        and the replacements whose restored records are held here."""
        return {
            "marks": self._marks.snapshot() if self._marks is not None else {},
            "closed_for": self.closed_for,
            "restored": sorted(self.restored.pending()),
        }

    def store_readiness(self, name: str, body: Any) -> None:
        if isinstance(body, Mapping) and name in self.roster.connected:
            self.readiness[name] = dict(body)
            self._readiness_changed.set()

    async def readiness_changed(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until a worker pushed readiness, registered or left; whether one did."""
        self._readiness_changed.clear()
        roster_changed = asyncio.ensure_future(self.roster.changed(timeout))
        pushed = asyncio.ensure_future(self._readiness_changed.wait())
        try:
            done, _ = await asyncio.wait([roster_changed, pushed], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            roster_changed.cancel()
            pushed.cancel()
            await asyncio.gather(roster_changed, pushed, return_exceptions=True)
        return bool(done)

    def _left(self, name: str) -> None:
        self.readiness.pop(name, None)
        self._refresh_refusals()

    def _refresh_refusals(self) -> None:
        if self._admission is None:
            return
        if self._served:
            self._admission.served = True
        left = self.roster.left
        if left:
            self._admission.restore_refusal = (
                f"{', '.join(left)} of this server left since it started: what a worker held (sessions, "
                "running episodes) may still be referred to, so a checkpoint is restored only into a server "
                "none of whose workers left"
            )

    async def _handle(self, link: Link, op: str, body: Any) -> Any:
        if op == REGISTER_OP:
            reply = self.roster.register(link, body)
            # After the roster's own callback: ``left`` already names the worker when this runs.
            link.on_close(lambda closed: self._left(str(closed.name)))
            if isinstance(body, Mapping) and body.get("served") is True:
                self._served = True
                self._refresh_refusals()
            return reply
        if link.name not in self.roster.connected:
            raise ValueError(f"{op} from a worker that has not registered")
        if op == m.SERVED:
            self._served = True
            self._refresh_refusals()
            return None
        if op == m.SESSION_CLOSED:
            # Every other worker drops what it holds of that session (its server never saw the close).
            others = [other for name, other in self.roster.links().items() if name != link.name]
            await asyncio.gather(
                *(other.call(m.SESSION_CLOSED, body, timeout=self.call_timeout) for other in others),
                return_exceptions=True,
            )
            return None
        if op == m.READINESS:
            self.store_readiness(link.name, body)
            return None
        if op == m.CONTROL:
            from .forward import answer_forwarded

            if self.control_app is None:
                raise ValueError("this coordinator serves no control routes")
            return await answer_forwarded(self.control_app, body)
        if op in (m.CLAIM, m.UNCLAIM):
            args = body if isinstance(body, Mapping) else {}
            (episode,) = m.episodes_from_wire([args.get("episode")])
            if op == m.UNCLAIM:
                given_back = [m.restored_from_wire(record) for record in args.get("records", ())]
                self.restored.unclaim(episode, link.name, given_back)
                return None
            claimed = self.restored.claim(episode, link.name)
            if claimed is None:
                return None
            return {
                "checkpoint_id": self.restored.checkpoint_id,
                "manifest": dict(self.restored.manifest),
                "records": [m.restored_to_wire(restored) for restored in claimed],
            }
        raise ValueError(f"unknown op {op!r}")
