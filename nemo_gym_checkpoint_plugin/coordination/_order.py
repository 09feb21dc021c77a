"""The coordination order: which participants a fan-out calls, stage by stage.

An order is a list of stages; each stage is a list of participant kinds. Stages
run one after the other; the participants of one stage are called at once.
The default (docs/protocol.md, "Coordination order"):

- ``prepare``: environment, then model, then agent, then resources.
- ``resume``: the reverse of prepare.
- ``commit``, ``restore``, ``renew``: every participant at once.
- ``retire``, ``forget``: environment, then agent, then model and resources together.

The order is answered by the core hook ``coordination_order(operation)``
(``firstresult``); ``DefaultCoordinationOrder`` answers it last (``trylast``), so a
plugin can reorder a deployment without forking. The library never relies on
pluggy's registration order for phases: the stages it runs are exactly the
list the hook returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._markers import hookimpl

__all__ = [
    "KINDS",
    "OPERATIONS",
    "DefaultCoordinationOrder",
    "default_order",
    "order_manager",
    "stages_for",
]

KINDS = ("environment", "model", "agent", "resources")
OPERATIONS = ("prepare", "commit", "resume", "restore", "retire", "forget", "renew")

_PREPARE = (("environment",), ("model",), ("agent",), ("resources",))
_ALL_AT_ONCE = (KINDS,)
_RETIRE = (("environment",), ("agent",), ("model", "resources"))

_DEFAULT: dict[str, tuple[tuple[str, ...], ...]] = {
    "prepare": _PREPARE,
    "resume": tuple(reversed(_PREPARE)),
    "commit": _ALL_AT_ONCE,
    "restore": _ALL_AT_ONCE,
    "renew": _ALL_AT_ONCE,
    "retire": _RETIRE,
    "forget": _RETIRE,
}


def default_order(operation: str) -> list[list[str]]:
    """The docs/protocol.md stages for ``operation``; ``ValueError`` for an unknown operation."""
    try:
        stages = _DEFAULT[operation]
    except KeyError:
        raise ValueError(f"unknown coordination operation {operation!r}; known: {', '.join(OPERATIONS)}") from None
    return [list(stage) for stage in stages]


class DefaultCoordinationOrder:
    """Core plugin answering ``coordination_order`` with docs/protocol.md's orders (``trylast``)."""

    @hookimpl(trylast=True)
    def coordination_order(self, operation: str) -> list[list[str]] | None:
        return default_order(operation) if operation in _DEFAULT else None


def _check(operation: str, stages: Any) -> list[list[str]]:
    """Refuse an order a plugin returned that would skip or repeat a kind, or name an unknown one."""
    if not isinstance(stages, Sequence) or isinstance(stages, str):
        raise ValueError(f"coordination_order({operation!r}) returned {stages!r}, not a list of stages")
    result = [list(stage) for stage in stages]
    seen = [kind for stage in result for kind in stage]
    unknown = sorted(set(seen) - set(KINDS))
    if unknown:
        raise ValueError(f"coordination_order({operation!r}) names unknown kinds {unknown}")
    if len(seen) != len(set(seen)) or set(seen) != set(KINDS):
        raise ValueError(f"coordination_order({operation!r}) must name each of {list(KINDS)} exactly once: {result}")
    return result


def stages_for(pm: Any, operation: str) -> list[list[str]]:
    """The stages of ``operation``: the ``coordination_order`` hook's answer, else the default.

    ``pm`` is a pluggy manager or ``None``. A manager without the hook (or whose plugins
    all answer ``None``) gets the default order.
    """
    hook = getattr(getattr(pm, "hook", None), "coordination_order", None) if pm is not None else None
    if hook is not None:
        answer = hook(operation=operation)
        if answer is not None:
            return _check(operation, answer)
    return default_order(operation)


def order_manager(extra_plugins: Sequence[Any] = (), *, load_entry_points: bool = True) -> Any:
    """The controller side's plugin manager: the default order plus the ``nemo_gym_checkpoint`` group.

    An installed plugin answering ``coordination_order`` reorders the deployment. No server
    runtime plugin is registered here (no storage backend, no lease policy).
    """
    from .._plugins import make_plugin_manager

    return make_plugin_manager(
        extra_plugins, load_entry_points=load_entry_points, builtins=(DefaultCoordinationOrder(),)
    )
