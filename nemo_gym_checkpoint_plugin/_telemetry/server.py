"""The telemetry of one participant server's control plane: what its operations report, in one place.

The plane (``_control/``) builds one ``ServerTelemetry`` and reports through it: each control call
(``call``), each stage of an operation (``stage``), admission closing and reopening, a published
checkpoint, an installed restore. Only a plane builds it, so with checkpointing off none exists.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from .metrics import ServerMetrics

__all__ = ["ServerTelemetry"]

logger = logging.getLogger(__name__)


class ServerTelemetry:
    """Metrics of one participant server (``metrics``), fed by its control plane."""

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

    @asynccontextmanager
    async def call(self, phase: str, checkpoint_id: str) -> AsyncIterator[None]:
        """One control call: its duration by phase, and its failure by code (a cancelled call is neither)."""
        started = time.monotonic()
        try:
            yield
        except Exception as exc:
            self.metrics.call_ended(phase, time.monotonic() - started, exc)
            raise
        self.metrics.call_ended(phase, time.monotonic() - started)

    @contextmanager
    def stage(self, name: str, checkpoint_id: str) -> Iterator[None]:
        """One stage of an operation (wait_ready, export, write, read, install): its duration."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.metrics.stage_ended(name, time.monotonic() - started)

    def admission_closing(self) -> None:
        self.metrics.admission_closing()

    def admission_opened(self) -> None:
        self.metrics.admission_opened()

    def prepared(self, restarts: int) -> None:
        self.metrics.restarts_reported(restarts)

    def published(self, manifest: dict[str, Any], episodes: int, size: int | None) -> None:
        self.metrics.checkpoint_published(manifest, episodes, size)

    def installed(self) -> None:
        self.metrics.restore_installed()

    async def scrape(self, held_counts: Callable[[], Any]) -> bytes:
        """The Prometheus text, after refreshing what only the participants know (held responses)."""
        try:
            report = await held_counts()
        except Exception:  # a participant's ready hook failing must not fail the scrape
            logger.debug("ready counts unavailable for the metrics scrape", exc_info=True)
        else:
            self.metrics.set_held_responses(dict(report.counts))
        return self.metrics.exposition()
