"""The telemetry of one participant server's control plane: what its operations report, in one place.

The plane (``_control/``) builds one ``ServerTelemetry`` and reports through it: each control call
(``call``), each stage of an operation (``stage``), admission closing and reopening, a published
checkpoint, an installed restore. Only a plane builds it, so with checkpointing off none exists.
Each call and stage is a metric (``metrics.py``) and, while the ``checkpoint`` span group is on, a
span (``spans.py``): ``checkpoint <operation> serve`` with a child ``checkpoint <stage>`` per stage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from . import spans
from .metrics import ServerMetrics

__all__ = ["ServerTelemetry"]

logger = logging.getLogger(__name__)


def _reply_attributes(phase: str, reply: Mapping[str, Any]) -> dict[str, Any]:
    """What a control call's reply tells its span: episodes and records, and a prepare left not ready."""
    found: dict[str, Any] = {}
    episodes = reply.get("episode_ids") if phase == "commit" else reply.get("restored")
    if isinstance(episodes, list):
        found[spans.EPISODES] = len(episodes)
    manifest = reply.get("manifest")
    if isinstance(manifest, Mapping) and isinstance(manifest.get("record_count"), int):
        found[spans.RECORDS] = manifest["record_count"]
    if phase == "prepare" and reply.get("phase") != "prepared":
        found[spans.OUTCOME] = "not_ready"
    for key in ("retired_count", "forgotten_count"):
        if isinstance(reply.get(key), int):
            found[spans.EPISODES] = reply[key]
    return found


class ServerTelemetry:
    """Metrics (``metrics``) and spans of one participant server, fed by its control plane."""

    def __init__(
        self,
        kind: str,
        instance: str,
        *,
        active_operation: Callable[[], str | None],
        admission_open: Callable[[], bool],
        lease_expiries: Callable[[], int],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kind = kind
        self.instance = instance
        self.metrics = ServerMetrics(
            kind,
            instance,
            active_operation=active_operation,
            admission_open=admission_open,
            lease_expiries=lease_expiries,
            clock=clock,
        )
        # The last published checkpoint's (id, bytes): its commit reply's span carries the size.
        self._published: tuple[str, int | None] | None = None
        self._clock = clock
        # What ``status`` tells of the last published checkpoint (plugin field ``last_checkpoint``).
        self.last_checkpoint: dict[str, Any] | None = None

    def _attributes(self, checkpoint_id: str, **more: Any) -> dict[str, Any]:
        return {
            spans.CHECKPOINT_ID: checkpoint_id,
            spans.PARTICIPANT_KIND: self.kind,
            spans.PARTICIPANT_INSTANCE: self.instance,
            **more,
        }

    async def call(self, phase: str, checkpoint_id: str, work: Awaitable[dict[str, Any]]) -> dict[str, Any]:
        """Await one control call's ``work``: its duration by phase, its failure by code, and its span."""
        started = time.monotonic()
        attributes = self._attributes(checkpoint_id, **{spans.OPERATION: phase})
        with spans.span(f"checkpoint {phase} serve", attributes) as current:
            try:
                reply = await work
            except Exception as exc:
                self.metrics.call_ended(phase, time.monotonic() - started, exc)
                raise
            self.metrics.call_ended(phase, time.monotonic() - started)
            if current is not None:
                found = _reply_attributes(phase, reply)
                published = self._published
                if phase == "commit" and published is not None and published[0] == checkpoint_id:
                    found[spans.BYTES] = published[1]
                spans.set_attributes(current, **found)
            return reply

    @contextmanager
    def stage(self, name: str, checkpoint_id: str) -> Iterator[None]:
        """One stage of an operation (wait_ready, export, write, read, install): its duration and its span."""
        started = time.monotonic()
        try:
            with spans.span(f"checkpoint {name}", self._attributes(checkpoint_id, **{spans.STAGE: name})):
                yield
        finally:
            self.metrics.stage_ended(name, time.monotonic() - started)

    def admission_closing(self) -> None:
        self.metrics.admission_closing()

    def admission_opened(self, checkpoint_id: str) -> None:
        paused = self.metrics.admission_opened()
        last = self.last_checkpoint
        if paused is not None and last is not None and last["checkpoint_id"] == checkpoint_id:
            last["paused_seconds"] = paused  # the pause this checkpoint imposed, prepare to resume

    def prepared(self, restarts: int) -> None:
        self.metrics.restarts_reported(restarts)

    def published(self, checkpoint_id: str, manifest: dict[str, Any], episodes: int, size: int | None) -> None:
        """A checkpoint's manifest is durable (called in the commit's task: the commit's span gets the figures)."""
        self.metrics.checkpoint_published(manifest, episodes, size)
        self._published = (checkpoint_id, size)
        self.last_checkpoint = {
            "checkpoint_id": checkpoint_id,
            "published_at": self._clock(),
            "size_bytes": size,
            "records": manifest.get("record_count"),
            "episodes": episodes,
        }
        if spans.enabled():
            from opentelemetry import trace

            spans.set_attributes(
                trace.get_current_span(),
                **{spans.EPISODES: episodes, spans.RECORDS: manifest.get("record_count"), spans.BYTES: size},
            )

    def read(self, records: int) -> None:
        """A restore read ``records`` records (called in the restore's task: the restore's span gets the count)."""
        if spans.enabled():
            from opentelemetry import trace

            spans.set_attributes(trace.get_current_span(), **{spans.RECORDS: records})

    def installed(self) -> None:
        self.metrics.restore_installed()

    def status_fields(self) -> dict[str, Any]:
        """``last_checkpoint`` once this server published one (``paused_seconds`` once admission reopened)."""
        return {} if self.last_checkpoint is None else {"last_checkpoint": dict(self.last_checkpoint)}

    async def scrape(self, held_counts: Callable[[], Any]) -> bytes:
        """The Prometheus text, after refreshing what only the participants know (held responses) and, on a
        server with several workers, what only the workers' gates know."""
        try:
            report = await held_counts()
        except Exception:  # a participant's ready hook failing must not fail the scrape
            logger.debug("ready counts unavailable for the metrics scrape", exc_info=True)
        else:
            self.metrics.set_held_responses(dict(report.counts))
        refresh = self.metrics.refresh_gate
        if refresh is not None:
            try:
                await refresh()
            except Exception:  # the workers' last figures are served instead
                logger.warning("the workers' gate figures are unavailable for the metrics scrape", exc_info=True)
        return self.metrics.exposition()
