"""Checkpoint telemetry (docs/telemetry.md): per-server metrics in a registry of their own, and spans.

Nothing here is built unless checkpointing is on: the control plane builds its ``ServerTelemetry``.
"""

from __future__ import annotations

from .metrics import CONTENT_TYPE, METRICS, MetricName, ServerMetrics, error_code
from .server import ServerTelemetry

__all__ = ["CONTENT_TYPE", "METRICS", "MetricName", "ServerMetrics", "ServerTelemetry", "error_code"]
