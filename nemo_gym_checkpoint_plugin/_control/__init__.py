"""The control plane of one participant server (phases, fencing, replay, lease, marks).

``ControlPlane`` is the state machine; ``Participants`` the typed facade over the
participant hooks; ``types`` the values exchanged with participant plugins.
"""

from __future__ import annotations

from .._types import (
    MAX_DEADLINE_AHEAD_SECONDS,
    AdmissionNotReopened,
    DeadlineTooFar,
    LeasePolicy,
    ParticipantExport,
    Phase,
    PrepareReport,
    Readiness,
    RestoredRecord,
    SeedDeclaration,
)
from .facade import Participants, maybe_awaitable
from .lease import DefaultLeasePolicy, Lease
from .memory import RESUMED_MEMORY
from .plane import ControlPlane

__all__ = [
    "MAX_DEADLINE_AHEAD_SECONDS",
    "RESUMED_MEMORY",
    "AdmissionNotReopened",
    "DeadlineTooFar",
    "ControlPlane",
    "DefaultLeasePolicy",
    "Lease",
    "LeasePolicy",
    "ParticipantExport",
    "Participants",
    "Phase",
    "PrepareReport",
    "Readiness",
    "RestoredRecord",
    "SeedDeclaration",
    "maybe_awaitable",
]
