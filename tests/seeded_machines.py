"""Run a hypothesis rule-based state machine as one sequence per seed, for ``make fuzz`` and CI.

Hypothesis itself draws its first example as the simplest one and biases the next ones small, and stops
at the first failure: fine for shrinking, wrong for "run N independent sequences and count the
violations". ``run_seeded`` runs one sequence of a machine's own rules, preconditions and invariants
(those its ``@rule``, ``@precondition`` and ``@invariant`` decorators registered; a class attribute
``WEIGHTS``, ``{rule name: weight}``, makes some likelier than others), every choice drawn
from ``random.Random(seed)``: the same seed replays the same sequence of rules and arguments (the
processes' timing can still differ). The machine's ``finish()`` runs after the last step, its
``teardown()`` always.
"""

from __future__ import annotations

import inspect
import random
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from hypothesis.strategies import SearchStrategy

__all__ = ["Outcome", "run_seeded"]

_RULE = "hypothesis_stateful_rule"
_INVARIANT = "hypothesis_stateful_invariant"


@dataclass
class Outcome:
    seed: int
    steps: list[str] = field(default_factory=list)
    violation: str | None = None
    seconds: float = 0.0

    def report(self, name: str) -> str:
        lines = [f"violation: {name} seed={self.seed} (replay: FUZZ_SEED={self.seed} FUZZ_SEQUENCES=1 make fuzz)"]
        lines += [f"  step {i}: {step}" for i, step in enumerate(self.steps)]
        lines += [f"  {line}" for line in (self.violation or "").rstrip().splitlines()]
        return "\n".join(lines)


class _Data:
    """What ``st.data()`` gives a rule: ``draw`` from the sequence's random source."""

    def __init__(self, rng: random.Random, drawn: list[str]) -> None:
        self.rng, self.drawn = rng, drawn

    def draw(self, strategy: SearchStrategy[Any], label: str | None = None) -> Any:
        value = _draw(strategy, self.rng, self.drawn)
        self.drawn.append(f"{label or 'draw'}={value!r}")
        return value


def _draw(strategy: SearchStrategy[Any], rng: random.Random, drawn: list[str]) -> Any:
    inner = getattr(strategy, "wrapped_strategy", strategy)
    name = type(inner).__name__
    if name == "DataStrategy":
        return _Data(rng, drawn)
    elements = getattr(inner, "elements", None)
    if elements is not None:
        return rng.choice(list(elements))
    if repr(strategy) == "booleans()":
        return rng.random() < 0.5
    raise TypeError(f"seeded machines draw sampled_from, booleans and data only, not {strategy!r}")


def _registered(machine_class: type, marker: str) -> list[Any]:
    found = [getattr(f, marker) for _, f in inspect.getmembers(machine_class) if getattr(f, marker, None) is not None]
    return sorted(found, key=lambda r: r.function.__name__)


def run_seeded(machine_class: type, seed: int, steps: int) -> Outcome:
    """One sequence of at most ``steps`` rules chosen by ``seed``; its violation, if any, in ``Outcome``."""
    rng = random.Random(seed)
    outcome = Outcome(seed)
    rules, invariants = _registered(machine_class, _RULE), _registered(machine_class, _INVARIANT)
    started = time.monotonic()
    machine = None
    try:
        machine = machine_class()
        for _ in range(steps):
            valid = [r for r in rules if all(p(machine) for p in r.preconditions)]
            if not valid:
                break
            weights = getattr(machine_class, "WEIGHTS", {})
            chosen = rng.choices(valid, [weights.get(r.function.__name__, 1.0) for r in valid])[0]
            drawn: list[str] = []
            arguments = {name: _draw(s, rng, drawn) for name, s in sorted(chosen.arguments.items())}
            shown = [f"{k}={v!r}" for k, v in arguments.items() if not isinstance(v, _Data)]
            outcome.steps.append(f"{chosen.function.__name__}({', '.join(shown)})")
            chosen.function(machine, **arguments)
            if drawn:
                outcome.steps[-1] += f" drew {', '.join(drawn)}"
            for check in invariants:
                check.function(machine)
        outcome.steps.append("finish()")
        machine.finish()
    except Exception:  # noqa: BLE001 - any failure is the sequence's violation, reported with its seed
        outcome.violation = traceback.format_exc(limit=6)
    finally:
        if machine is not None:
            try:
                machine.teardown()
            except Exception:  # noqa: BLE001
                outcome.violation = (outcome.violation or "") + "teardown: " + traceback.format_exc(limit=4)
    outcome.seconds = time.monotonic() - started
    return outcome
