"""Contract test suites per participant kind (the hookspec docstrings of ``hookspecs.participant``, as tests).

Shipped in the wheel, so a third-party participant runs the very suites the built-in ones pass.
An implementation runs a suite by subclassing its ``Test*`` class in a ``tests/test_*.py``
module and overriding the one fixture ``make_harness``: an async factory that builds a new,
empty server of that kind (one call = one server process, so a second call stands for the
process that restores after a crash) and returns a ``Harness`` over it. The suites are async
tests: run them with pytest-asyncio (``asyncio_mode = "auto"``). Import the suite module, not
the class, so pytest does not also collect the fixture-less base::

    from nemo_gym_checkpoint_plugin.testing.contracts import agent as agent_contract

    class TestMyAgent(agent_contract.TestAgentContract):
        @pytest.fixture
        def make_harness(self, ...): ...

The modules here are not named ``test_*.py``: pytest never collects the bases on their own.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from nemo_gym_checkpoint_plugin._identity import EpisodeId

__all__ = ["Harness", "MakeHarness", "call_hook"]


class Harness(Protocol):
    """One server of the kind under test, with its participant plugin, driven as Gym drives it.

    ``start`` opens an episode the way the server's real callers do (over its HTTP routes),
    with a session id derived from the rollout id only, so a later attempt of the same
    rollout reuses it. ``available`` says whether the server would serve ``episode`` now as
    that exact attempt. ``start_restart`` opens an episode the participant must report as a
    restart; a kind that has none raises ``NotImplementedError``.
    """

    participant: Any

    async def start(self, episode: EpisodeId) -> None: ...

    async def start_restart(self, episode: EpisodeId) -> None: ...

    def available(self, episode: EpisodeId) -> bool: ...

    def bad_record(self, episode: EpisodeId) -> Mapping[str, Any]:
        """A record this participant must refuse to install (e.g. without its session id)."""
        ...

    async def status(self) -> Mapping[str, Any]:
        """The control plane's ``status`` reply for this server (docs/protocol.md)."""
        ...


MakeHarness = Callable[[], Awaitable[Harness]]


async def call_hook(plugin: Any, name: str, **kwargs: Any) -> Any:
    """Call one hook implementation of ``plugin`` by keyword, as the control plane does (awaiting if async).

    A plugin that does not implement the hook answers ``None``, as pluggy leaves it out. Like pluggy,
    only the arguments the implementation names are passed; ``install`` gets its ``scope`` (the
    replacement of every record) when the caller gives none.
    """
    implementation = getattr(plugin, name, None)
    if implementation is None:
        return None
    if name == "install" and "scope" not in kwargs:
        # What the control plane passes: the replacement attempt of every episode the restore continues.
        kwargs["scope"] = [restored.replacement for restored in kwargs.get("records", ())]
    # As pluggy calls a hook implementation: with the arguments it names (a plugin may take fewer).
    accepted = inspect.signature(implementation).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        kwargs = {key: value for key, value in kwargs.items() if key in accepted}
    result = implementation(**kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result
