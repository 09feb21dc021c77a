"""Launch a real NeMo Gym deployment from the wheel's own servers, on 127.0.0.1, without Ray.

One ``Deployment`` owns five processes: the fake inference backend
(``python -m nemo_gym_checkpoint_plugin.testing.fake_backend``, from the installed
package) and the four Gym servers of ``gym_config`` (names,
ports and the config itself are built there). ``replicas=K`` adds K - 1 more
model -> agent -> environment chains (``policy_model_2``, ``simple_agent_2``,
``single_agent_turn_2``, ...: ``gym_config.gym_servers``), each its own processes,
ports and log files, sharing the resources server and the fake backend: one process
holds at most ~9,500 rollouts in its agent turn under a 20,000 file-descriptor limit,
so a chain per ~9,000 rollouts keeps every process under it. How each process starts (argv,
cwd, environment, readiness probe) is ``process_specs.py``'s; this module starts them, waits
for them and stops them. Override a server's entrypoint with ``entrypoints={name: ...}``;
the override is written into the config's ``entrypoint:`` so the YAML tells the truth.

Process groups: with ``own_process_groups=True`` (tests) each child leads its own
group, and ``stop``/``kill`` signal whole groups, so nothing a server spawned survives.
With ``False`` (``make serve``) children stay in the caller's group, so a SIGKILL of
that group takes every server down with it.

Spawning: a child is a plain ``subprocess.Popen`` unless a ``Zygote`` is in use (``spawner=``, or the
session's one that the testing kit's pytest plugin sets with ``use_zygote``): then a Gym server or the
backend is forked from it with the same argv, cwd, environment, session and log (``zygote.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .gym_config import (
    AGENT,
    BACKEND,
    DEFAULT_CHECKPOINT_BLOCK,
    ENVIRONMENT,
    GYM_SERVERS,
    HOST,
    MODEL,
    PORT_OFFSETS,
    PORT_SPAN,
    REPLICATED,
    RESOURCES,
    TOKEN_ENV,
    build_gym_config,
    gym_servers,
    port_span,
    replica_name,
    rollout_body,
)
from .ports import free_port_base, parse_port_base, port_is_free
from .process_specs import FAKE_BACKEND_MODULE, ProcessSpec, backend_spec, fake_backend_script, gym_specs
from .zygote import ForkedProcess, Zygote

# A child of a Deployment: a process of its own, or one forked from a zygote (the same calls answer).
ChildProcess = subprocess.Popen[bytes] | ForkedProcess
# The zygote every Deployment without a ``spawner`` uses (None: plain processes); see ``use_zygote``.
_session_zygote: Callable[[], Zygote | None] | None = None


def use_zygote(get: Callable[[], Zygote | None] | None) -> None:
    """Make ``get()`` the zygote of every ``Deployment`` built without ``spawner`` (None: plain processes).

    ``get`` is called at each spawn, so a zygote can be started on first use.
    """
    global _session_zygote
    _session_zygote = get


def spawn(
    argv: Sequence[str],
    *,
    cwd: str | os.PathLike[str],
    env: Mapping[str, str],
    stdout: int,
    stderr: int,
    start_new_session: bool = True,
    zygote: Zygote | None = None,
) -> ChildProcess:
    """Start ``argv`` as a ``Deployment`` starts its servers: forked from ``zygote`` (default: the session's,
    ``use_zygote``) when it can run it, else a plain ``Popen``. ``stdout``/``stderr`` are descriptors.

    For a test's other Python children that import Gym (a collector, say), so they skip its import too.
    """
    chosen = zygote or (_session_zygote() if _session_zygote is not None else None)
    if chosen is not None and chosen.can_run(argv):
        return chosen.spawn(argv, cwd=cwd, env=env, stdout=stdout, stderr=stderr, start_new_session=start_new_session)
    return subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=start_new_session,
    )


__all__ = [
    # Re-exported from gym_config so callers need one import.
    "AGENT",
    "BACKEND",
    "DEFAULT_CHECKPOINT_BLOCK",
    "ENVIRONMENT",
    "GYM_SERVERS",
    "HOST",
    "MODEL",
    "PORT_SPAN",
    "REPLICATED",
    "RESOURCES",
    "TOKEN_ENV",
    "build_gym_config",
    "gym_servers",
    "port_span",
    "replica_name",
    "rollout_body",
    # Re-exported from process_specs.
    "FAKE_BACKEND_MODULE",
    "ProcessSpec",
    "fake_backend_script",
    # Process management.
    "ChildProcess",
    "Deployment",
    "DeploymentAborted",
    "DeploymentError",
    "spawn",
    "use_zygote",
    "free_port_base",
    "parse_port_base",
    "port_is_free",
]

# The wait between readiness probes of servers not up yet; the loop itself is bounded by a deadline.
_PROBE_INTERVAL_SECONDS = 0.05


class DeploymentError(RuntimeError):
    """A server could not be started: a port is taken, a process exited early, or readiness timed out."""


class DeploymentAborted(DeploymentError):
    """``start`` was asked to give up (the caller's abort event was set) before every server was ready."""


# Readiness probes go straight to 127.0.0.1, never through a proxy from the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _responds(url: str, timeout: float) -> bool:
    try:
        with _DIRECT.open(url, timeout=timeout) as reply:
            return 200 <= reply.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Deployment:
    """The processes of one deployment; ``start``, ``stop``, ``kill``, then ``start`` again on the same ports.

    ``log_dir``: each child appends stdout and stderr to ``<log_dir>/<name>.log``; None sends
    both to this process's stderr (so this process's stdout stays its own).
    ``extra_env`` is added to every child's environment (e.g. the control token).
    ``model`` / ``environment`` add keys to the policy model's / environment server's block (``build_gym_config``).
    ``resources`` changes the resources server's implementation and block (``build_gym_config``);
    ``server_dirs`` (``{name: directory}``) runs a server from a directory of your own instead of
    the one Gym finds for its implementation (a server outside the nemo-gym wheel); ``python``
    is the interpreter every child runs (default this one's; e.g. a venv holding your plugin).
    ``gym_settings``: top-level Gym settings for every server (e.g. its aiohttp connection limits).
    ``replicas``: how many model -> agent -> environment chains (default 1: five processes);
    the ports then span ``port_span(replicas)`` from ``port_base``. ``server_dirs`` and
    ``entrypoints`` name a server's first replica and apply to all of its replicas.
    """

    def __init__(
        self,
        port_base: int,
        work_dir: Path,
        *,
        checkpoint: Mapping[str, Any] | None = DEFAULT_CHECKPOINT_BLOCK,
        entrypoints: Mapping[str, str] | None = None,
        own_process_groups: bool = True,
        log_dir: Path | None = None,
        extra_env: Mapping[str, str] | None = None,
        model: Mapping[str, Any] | None = None,
        resources: Mapping[str, Any] | None = None,
        server_dirs: Mapping[str, Path] | None = None,
        python: str | None = None,
        gym_settings: Mapping[str, Any] | None = None,
        replicas: int = 1,
        environment: Mapping[str, Any] | None = None,
        spawner: Zygote | None = None,
    ) -> None:
        from omegaconf import OmegaConf

        self.port_base = port_base
        self.spawner = spawner
        # What start() waits by default (servers with several uvicorn workers start slower).
        self.start_timeout = 120.0
        self.work_dir = Path(work_dir)
        self.own_process_groups = own_process_groups
        self.log_dir = log_dir
        self.extra_env = dict(extra_env or {})
        self.config = build_gym_config(
            port_base,
            self.work_dir,
            checkpoint=checkpoint,
            entrypoints=entrypoints,
            model=model,
            resources=resources,
            gym_settings=gym_settings,
            replicas=replicas,
            environment=environment,
        )
        self.replicas = replicas
        self.config_yaml: str = OmegaConf.to_yaml(self.config)
        python = python or sys.executable
        backend = backend_spec(port_base + PORT_OFFSETS[BACKEND], self.work_dir, python)
        names = gym_servers(replicas)
        # A replica runs from its first replica's directory unless given its own.
        dirs = {
            replica_name(name, i): path
            for name, path in (server_dirs or {}).items()
            for i in range(1, (replicas if name in REPLICATED else 1) + 1)
        }
        self.specs = [backend, *gym_specs(self.config, self.config_yaml, dirs, python, names)]
        self._procs: dict[str, ChildProcess] = {}

    @property
    def urls(self) -> dict[str, str]:
        """``{name: base url}`` of every server, the fake backend included."""
        return {spec.name: spec.url for spec in self.specs}

    def replica_urls(self, name: str) -> list[str]:
        """The base URL of every replica of ``name`` (``ENVIRONMENT``, ``AGENT`` or ``MODEL``), replica 1 first."""
        urls = self.urls
        return [urls[replica_name(name, i)] for i in range(1, (self.replicas if name in REPLICATED else 1) + 1)]

    @property
    def processes(self) -> dict[str, ChildProcess]:
        return dict(self._procs)

    @property
    def process_groups(self) -> dict[str, int]:
        """``{name: pgid}`` of the running children (all equal to the caller's when groups are shared)."""
        return {name: os.getpgid(proc.pid) for name, proc in self._procs.items() if proc.poll() is None}

    def write_config(self, path: Path) -> Path:
        """Write the Gym YAML the servers run with (what they get in ``NEMO_GYM_CONFIG_DICT``)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.config_yaml)
        return path

    def log_path(self, name: str) -> Path | None:
        return None if self.log_dir is None else self.log_dir / f"{name}.log"

    def start(self, timeout: float | None = None, abort: threading.Event | None = None) -> None:
        """Start every process not running (all of them, unless ``kill(only=...)`` spared some); return once ready.

        ``timeout`` defaults to ``start_timeout`` (120 s unless the builder set more). Raises
        ``DeploymentError`` (every child stopped first) if a port is taken, a child exits, or
        ``timeout`` passes; ``DeploymentAborted`` when ``abort`` is set meanwhile.
        """
        if timeout is None:
            timeout = self.start_timeout
        specs = [spec for spec in self.specs if spec.name not in self._procs]
        if not specs:
            raise DeploymentError("deployment already started; stop() or kill() it first")
        taken = [spec.url for spec in specs if not port_is_free(int(spec.url.rsplit(":", 1)[1]))]
        if taken:
            raise DeploymentError(f"ports already in use: {taken}")
        # The backend's cwd.
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for spec in specs:
                self._procs[spec.name] = self._spawn(spec)
            self._wait_ready(specs, time.monotonic() + timeout, abort)
        except BaseException:
            self.kill()
            raise

    def _spawn(self, spec: ProcessSpec) -> ChildProcess:
        env = {
            **os.environ,
            **self.extra_env,
            **spec.env,
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
            # Servers call each other on 127.0.0.1; a proxy from the environment must never see that traffic.
            "NO_PROXY": ",".join(p for p in (os.environ.get("NO_PROXY"), HOST, "localhost") if p),
            "no_proxy": ",".join(p for p in (os.environ.get("no_proxy"), HOST, "localhost") if p),
        }
        log_path = self.log_path(spec.name)
        # The child keeps its own copy of the descriptor; ours is closed as soon as it is spawned.
        log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115
        output = log.fileno() if log is not None else sys.stderr.fileno()
        try:
            return spawn(
                spec.argv,
                cwd=spec.cwd,
                env=env,
                stdout=output,
                stderr=output,
                start_new_session=self.own_process_groups,
                zygote=self.spawner,
            )
        finally:
            if log is not None:
                log.close()

    def _wait_ready(self, specs: list[ProcessSpec], deadline: float, abort: threading.Event | None) -> None:
        pending = list(specs)
        while pending:
            if abort is not None and abort.is_set():
                raise DeploymentAborted("start aborted before every server was ready")
            for spec in list(pending):
                code = self._procs[spec.name].poll()
                if code is not None:
                    raise DeploymentError(
                        f"{spec.name} exited with status {code} before it was ready{self._tail(spec)}"
                    )
                if _responds(spec.url + spec.ready_path, timeout=1.0):
                    pending.remove(spec)
            if pending and time.monotonic() >= deadline:
                names = [spec.name for spec in pending]
                raise DeploymentError(f"servers not ready before the deadline: {names}")
            if pending:
                time.sleep(_PROBE_INTERVAL_SECONDS)  # wait-ok: interval between probes of a bounded readiness poll

    def _tail(self, spec: ProcessSpec, lines: int = 30) -> str:
        path = self.log_path(spec.name)
        if path is None or not path.exists():
            return ""
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        return "; last log lines:\n" + "\n".join(tail)

    def _signal(self, proc: ChildProcess, sig: signal.Signals) -> None:
        try:
            if self.own_process_groups:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every child (its whole group when groups are owned); SIGKILL whatever outlives ``grace``."""
        procs = list(self._procs.values())
        for proc in procs:
            if proc.poll() is None:
                self._signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self, only: Iterable[str] | None = None) -> None:
        """SIGKILL every child (its whole group when groups are owned) and reap it. Safe to call twice.

        ``only`` names the children to kill (e.g. every Gym server, ``GYM_SERVERS``, so the inference
        worker outlives the crash as a real one does); ``start`` then starts those again.
        """
        names = set(self._procs) if only is None else set(only) & set(self._procs)
        procs = [self._procs[name] for name in names]
        for proc in procs:
            # Also after the leader exited: anything it left in its group goes with it.
            self._signal(proc, signal.SIGKILL)
        for proc in procs:
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
                pass
        for name in names:
            del self._procs[name]
        # The leader is reaped, but what it spawned (uvicorn's workers, which hold the listening socket too)
        # may still be dying: wait, bounded, until their ports are free again, so start() can bind them.
        ports = [int(spec.url.rsplit(":", 1)[1]) for spec in self.specs if spec.name in names]
        deadline = time.monotonic() + 10.0
        while any(not port_is_free(port) for port in ports) and time.monotonic() < deadline:
            time.sleep(0.05)  # wait-ok: polling interval of a bounded condition wait

    def dead(self) -> dict[str, int]:
        """``{name: exit status}`` of children that exited while the deployment should be running."""
        return {name: code for name, proc in self._procs.items() if (code := proc.poll()) is not None}

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
