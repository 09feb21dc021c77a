"""The testing kit's deployment harness as pytest fixtures, for this project's tests and a participant's.

Load it in a ``conftest.py``::

    pytest_plugins = ["nemo_gym_checkpoint_plugin.testing.pytest_plugin"]

Fixtures (each deployment is real: the fake backend and four Gym servers from the nemo-gym
wheel, on free 127.0.0.1 ports, no Ray, each child leading its own process group):

- ``gym_deployment`` (module scope): one started ``GymHarness`` shared by a module's
  tests: the servers as shipped (the ``checkpoint:`` block enabled with ``HARNESS_TOKEN``,
  but no server wrapped, so none is a participant); stopped at teardown. Use distinct
  rollout ids per test.
- ``gym_deployment_factory`` (function scope): ``factory(**deployment_kwargs)`` starts a
  fresh ``GymHarness`` on its own free ports (``checkpoint=``, ``entrypoints=``, ``extra_env=``
  ... as ``Deployment`` takes them; ``entrypoints=gym_config.wrapped_entrypoints()`` makes
  every server a participant); every one it made is stopped at teardown.

- ``participant_servers`` (function scope, async): ``make(server_class, name=..., block=...)``
  builds a server in this process as a participant (``inprocess.build_server``: the full
  attachment, entry-point plugins included), driven over ASGI; for the contract suites.

A ``GymHarness`` gives the servers' URLs, ``fake`` (hold, release and count the backend's
model calls), ``crash()`` (SIGKILL every process group) and ``restart()`` (fresh processes,
same config and ports). The rest of ``harness`` (``send_rollout``, ``send_wave``,
``wait_until``...) is imported from there.

Loading the plugin also loads ``reaper``: every process the run starts (servers, their
children, Ray's daemons under ``ng_run``) is killed at the end of the session, and by a
watchdog when pytest itself is killed, so no server outlives the run.

Servers of a ``Deployment`` are forked from one warm interpreter for the session (``zygote``: Gym's
libraries imported once, not once per server), started when the first deployment starts;
``NG_CHECKPOINT_TEST_ZYGOTE=0`` starts each as a plain process instead.
"""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import pytest_asyncio

from . import reaper
from .deployment import Deployment, use_zygote
from .harness import GymHarness, new_deployment
from .zygote import Zygote, ZygoteError

__all__ = ["gym_deployment", "gym_deployment_factory", "participant_servers"]

_RUN = pytest.StashKey[str]()
ZYGOTE_ENV = "NG_CHECKPOINT_TEST_ZYGOTE"


class _SessionZygote:
    """The session's zygote, started on first use; if it cannot start, servers start as plain processes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._zygote: Zygote | None = None
        self.failure: str | None = None

    def __call__(self) -> Zygote | None:
        with self._lock:
            if self._zygote is None and self.failure is None:
                try:
                    self._zygote = Zygote()
                except (ZygoteError, OSError) as exc:
                    self.failure = str(exc)
            return self._zygote

    def close(self) -> None:
        with self._lock:
            if self._zygote is not None:
                self._zygote.close()
                self._zygote = None


_ZYGOTE = pytest.StashKey[_SessionZygote]()


def pytest_configure(config: pytest.Config) -> None:
    # Before any test starts a process: each inherits the run's mark (``reaper``).
    run = config.stash[_RUN] = reaper.new_run()
    reaper.start_watchdog(run)
    if os.environ.get(ZYGOTE_ENV, "1") != "0":
        zygote = config.stash[_ZYGOTE] = _SessionZygote()
        use_zygote(zygote)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    zygote = session.config.stash.get(_ZYGOTE, None)
    if zygote is not None:
        use_zygote(None)
        zygote.close()
        if zygote.failure is not None and reporter is not None:
            reporter.write_line(f"zygote: not used, servers started as plain processes: {zygote.failure}", yellow=True)
    run = session.config.stash.get(_RUN, None)
    if run is None:
        return
    killed = reaper.sweep(run)
    if killed:
        message = f"reaper: killed {len(killed)} process(es) the tests left running: {killed}"
        if reporter is not None:
            reporter.write_line(message, yellow=True)


@pytest.fixture(scope="module")
def gym_deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GymHarness]:
    deployment = new_deployment(tmp_path_factory.mktemp("gym-deployment"))
    deployment.start()
    try:
        yield GymHarness(deployment)
    finally:
        deployment.stop()


@pytest.fixture
def gym_deployment_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., GymHarness]]:
    made: list[Deployment] = []

    def factory(**kwargs: Any) -> GymHarness:
        deployment = new_deployment(tmp_path_factory.mktemp("gym-deployment"), **kwargs)
        made.append(deployment)
        deployment.start()
        return GymHarness(deployment)

    try:
        yield factory
    finally:
        for deployment in made:
            deployment.stop()


@pytest_asyncio.fixture
async def participant_servers(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Callable[..., Any]]:
    """``make(server_class, name=..., block=...)``: ``inprocess.build_server`` with a control token set.

    Every server it built has its control plane closed at teardown.
    """
    from .inprocess import build_server

    monkeypatch.setenv("NG_CHECKPOINT_TOKEN", "participant-servers-token")
    made: list[Any] = []

    def make(server_class: type, **kwargs: Any) -> Any:
        made.append(build_server(server_class, **kwargs))
        return made[-1]

    try:
        yield make
    finally:
        for server in made:
            await server.aclose()
