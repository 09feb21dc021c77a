"""Shared test settings. Process-level tests never start Ray and only use 127.0.0.1."""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from nemo_gym_checkpoint_plugin._telemetry import spans
from nemo_gym_checkpoint_plugin.testing.s3_server import LocalS3Server

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# Property tests draw the same examples on every run by default ("ci": derandomized, no example database),
# so a red run is reproducible and CI never goes red on a seed nobody saw. HYPOTHESIS_PROFILE=explore draws
# new ones each run, for looking for failures on purpose. Neither times examples: hypothesis' deadline and
# its too_slow health check measure wall time, which on a loaded 2-core machine says how busy it is (a
# draw once took 1.2 s at load 15 and failed CI), not whether the code is right; speed lives in benchmarks/.
_UNTIMED = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("ci", derandomize=True, database=None, **_UNTIMED)
settings.register_profile("explore", derandomize=False, **_UNTIMED)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The testing kit's fixtures (gym_deployment, gym_deployment_factory), as a participant's own tests load them.
pytest_plugins = ["nemo_gym_checkpoint_plugin.testing.pytest_plugin"]


@pytest.fixture(autouse=True)
def _logging_as_found() -> Iterator[None]:
    """Every logger's handlers and level as before the test.

    Tests that parse a Gym config in process run Hydra's job logging (a root handler on the stream
    pytest captured for that test, and a file handler), and in-process uvicorn adds handlers of its
    own; left in place, a later test's log line meets a closed stream ("--- Logging error ---" on
    its stderr), so a test's outcome would depend on which ran before it.
    """
    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    saved = {id(lg): (lg, lg.handlers[:], lg.level) for lg in loggers}
    yield
    for lg in [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]:
        before = saved.get(id(lg))
        handlers, level = (before[1], before[2]) if before is not None else ([], logging.NOTSET)
        for handler in lg.handlers:
            if handler not in handlers:
                handler.close()
        lg.handlers[:] = handlers
        lg.setLevel(level)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3Server]:
    """One real S3-compatible server (moto's server mode) on 127.0.0.1 for the session, its bucket
    created; the standard AWS variables point this process (and every child it starts) at it."""
    from nemo_gym_checkpoint_plugin._storage.objstore import reset_filesystems

    server = LocalS3Server(log=tmp_path_factory.mktemp("s3") / "moto.log").start()
    saved = server.apply()
    reset_filesystems()
    try:
        yield server
    finally:
        server.stop()
        LocalS3Server.restore(saved)
        reset_filesystems()


@pytest.fixture
def s3_dir(s3_server: LocalS3Server, request: pytest.FixtureRequest) -> str:
    """A fresh ``s3://`` prefix for one test in the session's server."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name)[:60].strip("-.")
    return s3_server.url(f"{name}-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def lenient_store() -> Iterator[str]:
    """``lenient://bucket/run``: a store that accepts a second exclusive create (``storage_support``)."""
    import fsspec
    from storage_support import LenientMemoryFileSystem

    from nemo_gym_checkpoint_plugin._storage.objstore import reset_filesystems

    fsspec.register_implementation("lenient", LenientMemoryFileSystem, clobber=True)
    reset_filesystems()
    try:
        yield "lenient://bucket/run"
    finally:
        LenientMemoryFileSystem.store.clear()
        reset_filesystems()


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """The checkpoint spans this test process records (an SDK provider with an in-memory exporter)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with spans.recording(provider):
        yield memory
