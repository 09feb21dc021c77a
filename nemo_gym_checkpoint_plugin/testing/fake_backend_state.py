"""The fake inference backend's counters, hold rules and held calls (``fake_backend.py`` serves them)."""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FakeBackendState", "HeldCall", "HoldRule"]


@dataclass
class HoldRule:
    """Hold the next ``remaining`` calls whose conversation contains ``match`` (at ``step`` when set)."""

    rule_id: int
    match: str
    step: int | None
    remaining: int

    def applies(self, conversation: str, step: int) -> bool:
        return self.remaining > 0 and self.match in conversation and (self.step is None or self.step == step)


@dataclass
class HeldCall:
    call_id: int
    conversation: str
    step: int
    released: asyncio.Event = field(default_factory=asyncio.Event)


class FakeBackendState:
    """Counters, hold rules and held calls; all mutated on the event loop, never across threads."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.held: dict[int, HeldCall] = {}
        self.reset()

    def reset(self) -> int:
        """Forget every counter and rule; release (and forget) every held call. Returns how many were released."""
        released = self.release(None)
        self.calls: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.completed: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.calls_total = 0
        self.completed_total = 0
        self.abandoned_total = 0
        self.rules: list[HoldRule] = []
        self.delay_seconds = 0.0
        self.generating = 0
        return released

    def add_rule(self, match: str, count: int, step: int | None) -> HoldRule:
        rule = HoldRule(rule_id=next(self._ids), match=match, step=step, remaining=count)
        self.rules.append(rule)
        return rule

    def release(self, match: str | None) -> int:
        """Release every held call whose conversation contains ``match`` (all when None)."""
        chosen = [call for call in self.held.values() if match is None or match in call.conversation]
        for call in chosen:
            call.released.set()
            self.held.pop(call.call_id, None)
        return len(chosen)

    def drop_rules(self, match: str | None) -> int:
        """Drop the hold rules made with exactly ``match`` (all when None)."""
        kept = [rule for rule in self.rules if match is not None and rule.match != match]
        dropped = len(self.rules) - len(kept)
        self.rules = kept
        return dropped

    def arrive(self, conversation: str, step: int) -> HeldCall | None:
        """Count one call; return the hold it must wait on, if a rule claims it."""
        self.calls[conversation][step] += 1
        self.calls_total += 1
        for rule in self.rules:
            if rule.applies(conversation, step):
                rule.remaining -= 1
                call = HeldCall(call_id=next(self._ids), conversation=conversation, step=step)
                self.held[call.call_id] = call
                return call
        return None

    def answered(self, conversation: str, step: int) -> None:
        self.completed[conversation][step] += 1
        self.completed_total += 1

    def abandoned(self, call: HeldCall) -> None:
        if self.held.pop(call.call_id, None) is not None:
            self.abandoned_total += 1

    def counts(self) -> dict[str, int]:
        """The counters alone: what a caller polling for a condition at thousands of calls needs."""
        return {
            "held": len(self.held),
            "calls_total": self.calls_total,
            "completed_total": self.completed_total,
            "abandoned_total": self.abandoned_total,
        }

    def stats(self) -> dict[str, Any]:
        def table(counts: dict[str, dict[int, int]]) -> dict[str, dict[str, int]]:
            return {conv: {str(step): n for step, n in sorted(steps.items())} for conv, steps in counts.items()}

        return {
            "held": len(self.held),
            "held_calls": [{"conversation": c.conversation, "step": c.step} for c in self.held.values()],
            "rules": [
                {"rule_id": r.rule_id, "match": r.match, "step": r.step, "remaining": r.remaining}
                for r in self.rules
                if r.remaining > 0
            ],
            "calls_total": self.calls_total,
            "completed_total": self.completed_total,
            "abandoned_total": self.abandoned_total,
            "generating": self.generating,
            "delay_seconds": self.delay_seconds,
            "calls": table(self.calls),
            "completed": table(self.completed),
            "repeated": [
                {"conversation": conv, "step": step, "count": n}
                for conv, steps in self.calls.items()
                for step, n in sorted(steps.items())
                if n > 1
            ],
        }
