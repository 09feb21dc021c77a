"""The controller's checkpoint spans (docs/telemetry.md "Spans"): one per coordination operation, a child per call.

``checkpoint <operation>`` covers a fan-out (every stage of it); ``checkpoint <operation> call`` (CLIENT)
covers one participant's call and carries the ``traceparent`` the transport sends. Both exist only
while the ``checkpoint`` span group is selected (``_telemetry/spans.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry.trace import Span, SpanKind, StatusCode

from .._telemetry import spans
from ._discovery import Participant
from ._errors import ParticipantFailure

__all__ = ["call_outcome", "call_span", "operation_outcome", "operation_span"]


def _scope_size(payload: Mapping[str, Any]) -> int | None:
    for key in ("episode_ids", "rollout_ids"):
        value = payload.get(key)
        if isinstance(value, list):
            return len(value)
    return None


@contextlib.contextmanager
def operation_span(operation: str, payload: Mapping[str, Any] | None) -> Iterator[Span | None]:
    """``checkpoint <operation>`` around one fan-out (None while the span group is off, and for status)."""
    if payload is None or not spans.enabled():
        yield None
        return
    attributes = {spans.OPERATION: operation, spans.CHECKPOINT_ID: payload.get("checkpoint_id")}
    scope = _scope_size(payload)
    if scope is not None:
        attributes[spans.EPISODES] = scope
    with spans.span(f"checkpoint {operation}", attributes) as current:
        yield current


def operation_outcome(
    current: Span | None,
    replies: Mapping[str, Any],
    failures: list[ParticipantFailure],
    stopped_at: list[str] | None,
) -> None:
    if current is None:
        return
    found: dict[str, Any] = {spans.PARTICIPANTS: len(replies) + len(failures)}
    if failures:
        found[spans.OUTCOME] = "failed"
        found[spans.ERROR_TYPE] = failures[0].code
        current.set_status(StatusCode.ERROR, failures[0].code)
    elif stopped_at is not None:
        found[spans.OUTCOME] = "not_ready"
    spans.set_attributes(current, **found)


@contextlib.contextmanager
def call_span(operation: str, participant: Participant) -> Iterator[Span | None]:
    """``checkpoint <operation> call`` (CLIENT) around one participant call (none for status probes)."""
    if operation == "status" or not spans.enabled():
        yield None
        return
    attributes = {
        spans.OPERATION: operation,
        spans.PARTICIPANT_KIND: participant.kind,
        spans.PARTICIPANT_INSTANCE: participant.instance,
    }
    with spans.span(f"checkpoint {operation} call", attributes, kind=SpanKind.CLIENT) as current:
        yield current


def call_outcome(current: Span | None, outcome: dict[str, Any] | ParticipantFailure) -> None:
    if current is None:
        return
    if isinstance(outcome, ParticipantFailure):
        spans.set_attributes(current, **{spans.OUTCOME: "error", spans.ERROR_TYPE: outcome.code})
        current.set_status(StatusCode.ERROR, outcome.code)
        return
    found: dict[str, Any] = {}
    episodes = outcome.get("episode_ids") if operation_of(outcome) == "commit" else outcome.get("restored")
    if isinstance(episodes, list):
        found[spans.EPISODES] = len(episodes)
    manifest = outcome.get("manifest")
    if isinstance(manifest, Mapping) and isinstance(manifest.get("record_count"), int):
        found[spans.RECORDS] = manifest["record_count"]
    if outcome.get("phase") == "preparing":
        found[spans.OUTCOME] = "not_ready"
    spans.set_attributes(current, **found)


def operation_of(reply: Mapping[str, Any]) -> str | None:
    """``commit`` for a commit reply (it names the episodes it wrote), else None."""
    return "commit" if reply.get("phase") == "committed" else None
