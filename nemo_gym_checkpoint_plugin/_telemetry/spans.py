"""Checkpoint spans: OpenTelemetry API spans in the ``checkpoint`` span group (docs/telemetry.md "Spans").

Gym 0.7.0 selects span groups through nemo-lens: ``nemo_gym.telemetry._fallbacks.is_span_group_enabled``
answers whether a group is in the ``span_groups`` spec (that key of Gym's ``telemetry:`` block, or
``NEMO_GYM_OTEL_SPAN_GROUPS``), and a group must be registered with lens's ``SpanRegistry`` before
Gym's ``init_telemetry`` resolves the spec. Importing this module registers ``checkpoint`` under the
plugin's own namespace (a no-op without nemo-lens, where Gym's telemetry is off and so are these
spans). Select it with e.g. ``span_groups: "default,checkpoint"``.

Propagation is Gym's: the controller's call span writes ``traceparent`` into each control call
(``inject``), and on the participant Gym's FastAPI instrumentation (the ``server`` group) adopts it,
so the participant's spans are children of the controller's call; without that instrumentation the
control routes extract it themselves (``incoming``).

Every site checks ``enabled()`` first, so a span group that is off costs one set lookup per control
call and nothing on the data path. Tests switch the spans on with their own tracer provider
(``recording``), as nemo-lens would.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, StatusCode

from .metrics import error_code

__all__ = [
    "ATTRIBUTES",
    "NAMESPACE",
    "SPAN_GROUP",
    "TRACER_NAME",
    "enabled",
    "incoming",
    "inject",
    "recording",
    "register_span_group",
    "span",
]

logger = logging.getLogger(__name__)

SPAN_GROUP = "checkpoint"
# The nemo-lens registry namespace of this plugin's groups (Gym's own is "nemo_gym").
NAMESPACE = "nemo_gym_checkpoint"
TRACER_NAME = "nemo_gym_checkpoint"

# Span attributes: name -> meaning (docs/telemetry.md lists them from here).
CHECKPOINT_ID = "gym.checkpoint.id"
OPERATION = "gym.checkpoint.operation"
STAGE = "gym.checkpoint.stage"
PARTICIPANT_KIND = "gym.checkpoint.participant.kind"
PARTICIPANT_INSTANCE = "gym.checkpoint.participant.instance"
PARTICIPANTS = "gym.checkpoint.participants"
EPISODES = "gym.checkpoint.episodes"
RECORDS = "gym.checkpoint.records"
BYTES = "gym.checkpoint.size"
OUTCOME = "gym.checkpoint.outcome"
ERROR_TYPE = "error.type"

ATTRIBUTES: dict[str, str] = {
    CHECKPOINT_ID: "the checkpoint (or restore) id of the operation",
    OPERATION: "prepare, commit, restore, resume, retire, forget or renew",
    STAGE: "wait_ready, export, write, read or install (stage spans)",
    PARTICIPANT_KIND: "environment, model, agent or resources",
    PARTICIPANT_INSTANCE: "the participant's Gym config name",
    PARTICIPANTS: "participants a coordination operation called (controller spans)",
    EPISODES: "episodes written (commit), restored (restore) or named (retire, forget scope)",
    RECORDS: "records written or read",
    BYTES: "bytes of the records file written (unit By)",
    OUTCOME: "ok, not_ready (a prepare that replied preparing), failed (some participant refused), error, cancelled",
    ERROR_TYPE: "the protocol error code of a failure (OpenTelemetry's error.type)",
}


class _Selection:
    """Whether spans are on: Gym's span-group selection, unless a test switched them on itself."""

    def __init__(self) -> None:
        self.override: bool | None = None
        self.provider: trace.TracerProvider | None = None
        self._gym: Callable[[str], bool] | None = None

    def gym(self) -> Callable[[str], bool]:
        if self._gym is None:
            try:
                from nemo_gym.telemetry._fallbacks import is_span_group_enabled
            except Exception:  # a controller without nemo_gym importable: no span group can be on
                self._gym = lambda _group: False
            else:
                self._gym = is_span_group_enabled
        return self._gym


_SELECTION = _Selection()


def register_span_group() -> bool:
    """Declare the ``checkpoint`` group to nemo-lens (what Gym does for its own groups); False without lens."""
    try:
        from nemo.lens.groups import SpanRegistry  # type: ignore[import-not-found]
    except ImportError:
        return False
    try:
        SpanRegistry.register(NAMESPACE, groups=frozenset({SPAN_GROUP}), presets={}, allow_override=True)
    except Exception:  # telemetry must never stop a server or a controller
        logger.warning("could not register the %r span group with nemo-lens", SPAN_GROUP, exc_info=True)
        return False
    return True


def enabled() -> bool:
    """Whether the ``checkpoint`` span group is selected (one set lookup in Gym's telemetry)."""
    override = _SELECTION.override
    if override is not None:
        return override
    return bool(_SELECTION.gym()(SPAN_GROUP))


@contextmanager
def recording(provider: trace.TracerProvider) -> Iterator[None]:
    """Switch the spans on with ``provider`` (tests: an SDK provider with an in-memory exporter)."""
    previous = _SELECTION.override, _SELECTION.provider
    _SELECTION.override, _SELECTION.provider = True, provider
    try:
        yield
    finally:
        _SELECTION.override, _SELECTION.provider = previous


def _tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME, tracer_provider=_SELECTION.provider)


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in attributes.items() if isinstance(value, str | bool | int | float)}


def set_attributes(target: Span | None, **attributes: Any) -> None:
    """Set attributes (by their ``gym.checkpoint.*`` names given as keywords' values) on ``target``."""
    if target is not None and target.is_recording():
        target.set_attributes(_clean(attributes))


@contextmanager
def span(name: str, attributes: Mapping[str, Any], *, kind: SpanKind = SpanKind.INTERNAL) -> Iterator[Span | None]:
    """A current span ``name`` (None while the group is off) whose outcome and error code are set on exit."""
    if not enabled():
        yield None
        return
    with _tracer().start_as_current_span(
        name, kind=kind, attributes=_clean(attributes), record_exception=False, set_status_on_exception=False
    ) as current:
        try:
            yield current
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError | GeneratorExit):
                current.set_attribute(OUTCOME, "cancelled")
            else:
                code = error_code(exc)
                current.set_attributes({OUTCOME: "error", ERROR_TYPE: code})
                current.set_status(StatusCode.ERROR, code)
            raise
        attributes_now = getattr(current, "attributes", None) or {}
        if OUTCOME not in attributes_now:
            current.set_attribute(OUTCOME, "ok")


def inject(headers: MutableMapping[str, str]) -> None:
    """Write the current span's ``traceparent`` into ``headers`` (only while the group is on)."""
    if enabled():
        propagate.inject(headers)


@contextmanager
def incoming(headers: Mapping[str, str]) -> Iterator[None]:
    """Run a control call under the caller's trace when no server span (Gym's instrumentation) adopted it."""
    if not enabled() or trace.get_current_span().get_span_context().is_valid or "traceparent" not in headers:
        yield
        return
    token = otel_context.attach(propagate.extract(headers))
    try:
        yield
    finally:
        otel_context.detach(token)


register_span_group()
