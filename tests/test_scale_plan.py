"""``benchmarks/scale.py``'s plan: replica chains and rollouts in flight chosen so no process passes its fd limit."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "scale.py"
_spec = importlib.util.spec_from_file_location("scale_benchmark", _SCRIPT)
assert _spec is not None and _spec.loader is not None
scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale)

LIMIT = 20_000
PER_PROCESS = 9_000


@pytest.mark.parametrize(
    ("rollouts", "expected"),
    [(1_000, (1, 1_000)), (9_000, (1, 9_000)), (9_001, (2, 9_001)), (16_000, (2, 16_000))],
)
def test_default_replicas_hold_every_rollout_with_each_chain_under_its_budget(
    rollouts: int, expected: tuple[int, int]
) -> None:
    assert scale.plan(rollouts, None, None, PER_PROCESS, LIMIT) == expected


def test_by_default_the_rollouts_in_flight_stay_under_the_controllers_own_limit() -> None:
    # 30,000 rollouts over four chains: the chains could hold 36,000, the controller and backend not.
    replicas, in_flight = scale.plan(30_000, None, None, PER_PROCESS, LIMIT)
    assert replicas == 4 and in_flight < LIMIT


def test_an_explicit_replica_count_caps_what_is_in_flight_at_its_chains_budget() -> None:
    assert scale.plan(16_000, 1, None, PER_PROCESS, LIMIT) == (1, 9_000)


def test_too_few_replicas_for_the_rollouts_asked_in_flight_is_refused() -> None:
    with pytest.raises(ValueError, match="per replica chain"):
        scale.plan(16_000, 1, 16_000, PER_PROCESS, LIMIT)


def test_more_in_flight_than_one_controller_holds_is_refused() -> None:
    with pytest.raises(ValueError, match="this controller"):
        scale.plan(24_000, 3, 24_000, PER_PROCESS, LIMIT)
