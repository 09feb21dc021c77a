"""A stand-in for nemo-lens in a real server process (tests/test_telemetry_spans_process.py).

Gym 0.7.0 selects span groups and builds its tracer provider through nemo-lens, whose pinned build
cannot be installed here. When ``NG_CHECKPOINT_TEST_SPAN_FILE`` is set, this module (on the server's
``PYTHONPATH``, so the interpreter runs it at start-up) does the two things lens would: an
OpenTelemetry SDK tracer provider as the process's global one, exporting each span as it ends (a
JSON line appended to ``<file>.<pid>``, so a SIGKILL loses nothing ended), and Gym's span-group
question answered from ``NEMO_GYM_OTEL_SPAN_GROUPS``. Nothing of the plugin is replaced.
"""

from __future__ import annotations

import json
import os

_FILE = os.environ.get("NG_CHECKPOINT_TEST_SPAN_FILE")

if _FILE:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    class _LineExporter(SpanExporter):
        def __init__(self, path: str) -> None:
            self._path = path

        def export(self, spans):  # type: ignore[no-untyped-def]
            with open(self._path, "a", encoding="utf-8") as out:
                for span in spans:
                    parent = span.parent
                    out.write(
                        json.dumps(
                            {
                                "name": span.name,
                                "kind": span.kind.name,
                                "trace_id": format(span.context.trace_id, "032x"),
                                "span_id": format(span.context.span_id, "016x"),
                                "parent_id": format(parent.span_id, "016x") if parent is not None else None,
                                "attributes": dict(span.attributes or {}),
                                "pid": os.getpid(),
                            }
                        )
                        + "\n"
                    )
            return SpanExportResult.SUCCESS

    _provider = TracerProvider()
    _provider.add_span_processor(SimpleSpanProcessor(_LineExporter(f"{_FILE}.{os.getpid()}")))
    trace.set_tracer_provider(_provider)

    _GROUPS = frozenset(g.strip() for g in os.environ.get("NEMO_GYM_OTEL_SPAN_GROUPS", "").split(",") if g.strip())

    import nemo_gym.telemetry._fallbacks as _fallbacks

    _fallbacks.is_span_group_enabled = lambda group: group in _GROUPS
