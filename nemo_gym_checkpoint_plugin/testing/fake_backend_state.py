"""The fake inference backend's counters, hold rules, held calls and generation clock (``fake_backend.py`` serves them).

Generation runs token by token (``fake_generation.py``): at ``tokens_per_second`` (0: as fast as
the loop goes), frozen in place while the backend is paused (``/pause?mode=keep``, vLLM's dev-mode
route), and every token generated is counted per conversation, delivered or not, so a test sees
exactly what was generated again after a crash.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .fake_tokens import Vocabulary

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
        # Kept across resets: a reset drops counters and rules, not what the tokenizer knows.
        self.vocabulary = Vocabulary()
        self._resumed = asyncio.Event()
        self._resumed.set()
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
        self.tokens_per_second = 0.0
        self.generated: dict[str, int] = defaultdict(int)
        self.generated_total = 0
        self.pause_hangs = False
        self.pauses_total = 0
        # (match, tokens): the backend pauses itself once a conversation containing match generated that many.
        self.pause_at: tuple[str, int] | None = None
        self.resume()
        return released

    # -- the generation clock ----------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def pause(self) -> None:
        self.pauses_total += 1
        self._resumed.clear()

    def resume(self) -> None:
        self._resumed.set()

    async def token_turn(self, due: float) -> float:
        """Wait until the next token of a generation is due and the backend is not paused; its due time.

        ``due`` is when the previous token was due: the rate is kept without drift. A pause that
        arrives while a token is due freezes it too (no token is produced once ``/pause`` answered),
        and time spent paused does not count.
        """
        loop = asyncio.get_running_loop()
        if self.tokens_per_second > 0:
            due += 1.0 / self.tokens_per_second
            delay = due - loop.time()
            if delay > 0:
                # The rate is the simulated generation itself, not a stand-in for a condition.
                await asyncio.sleep(delay)  # wait-ok: simulated token generation
        while not self._resumed.is_set():
            await self._resumed.wait()
            due = loop.time()
        return due

    def count_token(self, conversation: str) -> None:
        self.generated[conversation] += 1
        self.generated_total += 1
        rule = self.pause_at
        if rule is not None and rule[0] in conversation and self.generated[conversation] >= rule[1]:
            # Frozen right after this token, as /pause?mode=keep would: a test's cut at an exact point.
            self.pause_at = None
            self.pause()

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
            "tokens_per_second": self.tokens_per_second,
            "paused": self.paused,
            "generated_total": self.generated_total,
            "generated": dict(self.generated),
            "calls": table(self.calls),
            "completed": table(self.completed),
            "repeated": [
                {"conversation": conv, "step": step, "count": n}
                for conv, steps in self.calls.items()
                for step, n in sorted(steps.items())
                if n > 1
            ],
        }
