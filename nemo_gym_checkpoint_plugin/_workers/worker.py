"""One uvicorn worker's side of a server with several workers: its local state, driven by the coordinator.

A ``Worker`` holds what the worker's admission gate reads (``admission``, ``marks``) and the
worker's own participant plugins (a plugin manager, called through the same typed facade the
``ControlPlane`` uses). ``start`` connects its link to the coordinator's socket, registers with
the worker's pid and applies the snapshot in the reply (the retired marks; admission closed for
a checkpoint), before it answers any of the coordinator's calls:

- ``close_admission`` / ``open_admission``: close or reopen the local gate, then the hooks;
- ``preparing``, ``ready`` (the merged ``Readiness``, and which checkpoint admission is closed
  for), ``wait_ready`` (bounded by the seconds the coordinator names: returns whether a hook
  returned), ``export`` (the records, materialized off the loop, and the extras);
- ``mark`` (the marks only: they reach every worker before any stops work), ``retire`` (mark,
  stop and free, then wait until requests parked under those attempts were answered), ``forget``;
- ``restored_pending``, ``delete_restored``, ``release_exported``; ``check_owners`` (which of
  the named record owners no local plugin installs).

A hook that raises a protocol refusal makes the coordinator's call raise the same refusal
(``link.py``); anything else is a ``LinkRemoteError`` there. ``claim`` asks the coordinator for
the restored record of a replacement attempt this worker received and installs it locally (one
owner: a record another worker claimed is refused ``attempt_running``). The first data request
the gate sees (``Admission.served``) is reported to the coordinator, which then refuses restores.

Readiness is pushed, not asked: a reporter task sends the worker's ``ready`` answer (for the
checkpoint admission is closed for) whenever it changed, looking again when nudged (admission,
marks), when a ``wait_ready`` hook returns and at least every ``report_seconds``; ``export``
checks readiness again first (a regression is ``export_failed``, as on one worker). In a server,
``attach.py`` builds the worker and starts it at the app's startup.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import pluggy

from nemo_gym_checkpoint_plugin._admission import Admission, RetiredMarks
from nemo_gym_checkpoint_plugin._control.facade import Participants
from nemo_gym_checkpoint_plugin._errors import ExportFailed
from nemo_gym_checkpoint_plugin._gate import GateCounters
from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._telemetry.metrics import ParkTimes
from nemo_gym_checkpoint_plugin._types import plain_record

from . import messages as m
from .gates import figures_to_wire
from .link import Link, LinkError, connect
from .roster import REGISTER_OP

__all__ = ["ReportingAdmission", "Worker"]

logger = logging.getLogger(__name__)


class ReportingAdmission(Admission):
    """An ``Admission`` that calls ``on_served`` once, when the gate first sets ``served``."""

    def __init__(self, on_served: Callable[[], None]) -> None:
        self._on_served = on_served
        self._served = False
        super().__init__()

    @property
    def served(self) -> bool:
        return self._served

    @served.setter
    def served(self, value: bool) -> None:
        first = bool(value) and not self._served
        self._served = bool(value)
        if first:
            self._on_served()


class Worker:
    """The coordinator's view from inside one worker. Use from the worker's event loop."""

    def __init__(
        self,
        pm: pluggy.PluginManager,
        *,
        pid: int | None = None,
        call_timeout: float = 10.0,
        report_seconds: float = 1.0,
    ) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.pm = pm
        self.participants = Participants(pm)
        self.admission: Admission = ReportingAdmission(self._report_served)
        self.marks = RetiredMarks()
        # What this worker's gate counts and how long its parks waited (the coordinator's metrics ask, gates.py).
        self.gate = GateCounters()
        self.park_times = ParkTimes()
        self.gate.observe_park = self.park_times.observe
        self.call_timeout = call_timeout
        # The checkpoint (or restore) admission is closed for; None while open.
        self.closed_for: str | None = None
        self.name: str | None = None
        self.link: Link | None = None
        self._applied = asyncio.Event()
        self._reports: set[asyncio.Task[Any]] = set()
        # Replacement capture keys whose restored records the coordinator holds (a first request claims one).
        self.restorable: set[str] = set()
        # Readiness pushed to the coordinator (``_reporter``): the last body sent, and what wakes the reporter.
        self.report_seconds = report_seconds
        self._pushed: dict[str, Any] | None = None
        self._nudge = asyncio.Event()
        self._reporter_task: asyncio.Task[None] | None = None

    async def start(self, path: str) -> None:
        """Connect to the coordinator at ``path``, register and apply its snapshot; a ``LinkError`` otherwise."""
        self.link = await connect(path, timeout=self.call_timeout, handler=self._handle)
        body = {"pid": self.pid, "served": self.admission.served}
        snapshot = await self.link.call(REGISTER_OP, body, timeout=self.call_timeout)
        await self._apply(snapshot)
        self._reporter_task = asyncio.get_running_loop().create_task(self._reporter())

    async def _apply(self, snapshot: Mapping[str, Any]) -> None:
        self.name = str(snapshot.get("worker"))
        for rollout_id, attempt in dict(snapshot.get("marks") or {}).items():
            self.marks.mark(rollout_id, attempt)
        self.restorable.update(str(key) for key in snapshot.get("restored") or ())
        closed_for = snapshot.get("closed_for")
        if closed_for is not None:
            await self._close(str(closed_for))
        self._applied.set()

    async def wait_closed(self) -> None:
        """Return once the link to the coordinator ended (the coordinator exited or dropped this worker)."""
        if self.link is not None:
            await self.link.wait_closed()

    async def aclose(self) -> None:
        for task in [*self._reports, *([self._reporter_task] if self._reporter_task is not None else [])]:
            task.cancel()
        if self.link is not None:
            await self.link.aclose()

    # -- readiness, pushed -----------------------------------------------------------------------

    async def readiness_body(self) -> dict[str, Any]:
        """This worker's readiness now, as pushed: for the checkpoint admission is closed for (None: open)."""
        checkpoint_id = self.closed_for
        try:
            report = await self.participants.ready(checkpoint_id)
        except Exception as exc:  # a blocker at the coordinator, naming this worker and the error
            error = f"{type(exc).__name__}: {exc}"
            return {"checkpoint_id": checkpoint_id, "closed_for": checkpoint_id, "error": error}
        return {"checkpoint_id": checkpoint_id, "closed_for": checkpoint_id, **m.readiness_to_wire(report)}

    def nudge(self) -> None:
        """Readiness may have changed (admission, marks): the reporter looks again now."""
        self._nudge.set()

    async def _reporter(self) -> None:
        """Push this worker's readiness to the coordinator whenever it changed, so its ``ready`` never waits.

        It looks again when nudged, when a ``wait_ready`` hook returns (while admission is closed for a
        checkpoint) and at least every ``report_seconds``.
        """
        link = self.link
        assert link is not None
        while not link.closed:
            self._nudge.clear()  # before looking: a nudge while this round runs makes another round
            body = await self.readiness_body()
            if body != self._pushed:
                try:
                    await link.call(m.READINESS, body, timeout=self.call_timeout)
                except LinkError as exc:
                    if link.closed:
                        return
                    logger.warning("%s: pushing readiness to the coordinator failed: %s", self.name, exc)
                else:
                    self._pushed = body
            await self._readiness_may_change()

    async def _readiness_may_change(self) -> None:
        waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(self._nudge.wait())]
        if self.closed_for is not None:
            waits.append(asyncio.ensure_future(self.participants.wait_ready(self.closed_for)))
        try:
            await asyncio.wait(waits, timeout=self.report_seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)  # a failing wait_ready shows in the next ready

    # -- restored records ------------------------------------------------------------------------

    async def claim(self, episode: EpisodeId) -> bool:
        """Install the restored record of replacement attempt ``episode`` here, if the coordinator holds one.

        False when it holds none (nothing to install). ``AttemptRunning`` when another worker claimed
        it. A local install that raises gives the record back to the coordinator, then raises.
        """
        assert self.link is not None, "start() first"
        pair = [episode.rollout_id, episode.attempt]
        reply = await self.link.call(m.CLAIM, {"episode": pair}, timeout=self.call_timeout)
        if reply is None:
            self.restorable.discard(episode.capture_key)
            return False
        records = [m.restored_from_wire(record) for record in reply["records"]]
        try:
            await self.participants.install(reply["checkpoint_id"], reply["manifest"], records, [episode], claimed=True)
        except BaseException:
            try:
                await self.link.call(
                    m.UNCLAIM, {"episode": pair, "records": reply["records"]}, timeout=self.call_timeout
                )
            except LinkError:
                logger.exception("%s: giving back the record of %s failed", self.name, episode.capture_key)
            raise
        self.restorable.discard(episode.capture_key)
        return True

    def _report_served(self) -> None:
        link = self.link
        if link is None:
            return  # registration says it

        async def report() -> None:
            try:
                await link.call(m.SERVED, None, timeout=self.call_timeout)
            except LinkError:
                logger.exception("%s: reporting the first data request to the coordinator failed", self.name)

        task = asyncio.get_running_loop().create_task(report())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    # -- the coordinator's calls -----------------------------------------------------------------

    def report_session_closed(self, session_id: str, episode: EpisodeId) -> None:
        """This worker closed a resources session: the coordinator tells the other workers (not awaited)."""
        link = self.link
        if link is None:
            return
        body = {"session_id": session_id, "episode": [episode.rollout_id, episode.attempt]}

        async def report() -> None:
            try:
                await link.call(m.SESSION_CLOSED, body, timeout=self.call_timeout)
            except LinkError:
                logger.exception("%s: relaying the close of %s failed", self.name, session_id)

        task = asyncio.get_running_loop().create_task(report())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _close(self, checkpoint_id: str) -> None:
        self.admission.close()
        self.closed_for = checkpoint_id
        await self.participants.close_admission(checkpoint_id)

    async def _handle(self, _link: Link, op: str, body: Any) -> Any:
        async with asyncio.timeout(self.call_timeout):
            await self._applied.wait()  # a call racing the registration waits for its snapshot
        args: dict[str, Any] = body if isinstance(body, dict) else {}
        if op == m.CLOSE_ADMISSION:
            await self._close(str(args["checkpoint_id"]))
            self.nudge()  # the reporter pushes the readiness for this checkpoint now
            return {"closed_for": self.closed_for}
        if op == m.PREPARING:
            await self.participants.preparing(str(args["checkpoint_id"]), float(args["deadline_ts"]))
            return None
        if op == m.OPEN_ADMISSION:
            self.closed_for = None
            self.admission.open()
            self.nudge()
            await self.participants.open_admission(str(args["checkpoint_id"]))
            return None
        if op == m.READY:
            report = await self.participants.ready(args.get("checkpoint_id"))
            return {**m.readiness_to_wire(report), "closed_for": self.closed_for}
        if op == m.WAIT_READY:
            try:
                async with asyncio.timeout(float(args["seconds"])):
                    await self.participants.wait_ready(str(args["checkpoint_id"]))
            except TimeoutError:
                return False
            return True
        if op == m.EXPORT:
            return await self._export(str(args["checkpoint_id"]), args.get("scope"))
        return await self._marks_op(op, args)

    async def _export(self, checkpoint_id: str, scope: Any) -> dict[str, Any]:
        # The coordinator's readiness is what this worker pushed: checked again here, now, before exporting.
        now = await self.participants.ready(checkpoint_id)
        if not now.ready:
            named = [*now.worker_blockers, *now.blockers]
            raise ExportFailed(
                f"readiness of {checkpoint_id} regressed on {self.name} since prepare: {len(named)} blocker(s) "
                f"({', '.join(named[:10])}); the checkpoint is over: resume it and prepare a new id",
                blockers=list(now.blockers[:100]),
            )
        exported = await self.participants.export(checkpoint_id, None if scope is None else frozenset(scope))
        # One message carries them: made in a thread (an export's iterator may be long), like the writer does.
        # A Versioned record is built here (a function does not cross processes): across workers, every
        # checkpoint writes each record whole (the coordinator's writer sees plain records only).
        records = await asyncio.to_thread(lambda: [plain_record(item) for item in exported.records])
        return {
            "records": records,
            "manifest_extras": dict(exported.manifest_extras),
            "reply_extras": dict(exported.reply_extras),
        }

    async def _marks_op(self, op: str, args: dict[str, Any]) -> Any:
        if op in (m.MARK, m.RETIRE):
            episodes = m.episodes_from_wire(args["episodes"])
            for episode in episodes:
                self.marks.mark(episode.rollout_id, episode.attempt)
            self.restorable.update(str(key) for key in args.get("restored") or ())
            self.nudge()
            if op == m.RETIRE:
                await self.participants.retire(episodes)
                # Data requests parked under these attempts were refused when marked; reply once they left.
                await self.marks.parked_left(episode.rollout_id for episode in episodes)
            return len(episodes)
        if op == m.FORGET:
            rollout_ids = [str(rollout_id) for rollout_id in args["rollout_ids"]]
            for rollout_id in rollout_ids:
                self.marks.forget(rollout_id)
            await self.participants.forgotten(rollout_ids)
            return len(rollout_ids)
        if op == m.SESSION_CLOSED:
            (episode,) = m.episodes_from_wire([args["episode"]])
            for _name, plugin in self.pm.list_name_plugin():
                closed_elsewhere = getattr(plugin, "session_closed_elsewhere", None)
                if callable(closed_elsewhere):
                    closed_elsewhere(str(args["session_id"]), episode)
            return None
        if op == m.STATUS_FIELDS:
            return await self.participants.status_fields()
        if op == m.GATE_FIGURES:
            return figures_to_wire(self.gate, self.park_times)
        if op == m.CHECK_OWNERS:
            return self.participants.missing_owners(str(owner) for owner in args["owners"])
        if op == m.RESTORED_PENDING:
            return sorted(await self.participants.restored_pending())
        if op == m.DELETE_RESTORED:
            await self.participants.delete_restored(m.episodes_from_wire(args["episodes"]))
            return None
        if op == m.RELEASE_EXPORTED:
            keys = [str(key) for key in args["episode_keys"]]
            await self.participants.release_exported(str(args["checkpoint_id"]), keys)
            return None
        raise ValueError(f"unknown op {op!r}")
