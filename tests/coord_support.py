"""Participant servers for coordination and CLI tests: real uvicorn processes on 127.0.0.1.

Each server runs the plugin's real control plane and routes (``ControlPlane`` +
``routes.attach``) with ``StubParticipant``, a small in-test participant plugin, behind
``ControlLog``, a middleware that logs every control call's arrival and reply
(CLOCK_MONOTONIC, shared by every process on the machine) with a digest of the raw
body, so tests observe the coordination order and the bytes each participant received
from the participant's own log.

Behaviour comes from a JSON spec in ``COORD_STUB``: ``kind``, ``instance``, ``token``,
``log`` (path); for the plugin ``holds`` (capture keys it exports), ``restarts``,
``blockers`` (never clear: a prepare replies ``preparing`` at its deadline),
``export_error`` (a code its export raises); for the middleware ``barrier``
({operation: count}, with ``barrier_dir``: hold the call until that many participants
received it, so "sent at once" is observable without racing), ``hang`` (operations
never answered), ``fail`` ({operation: code, or [code, capture keys it names]} answered as
that refusal), ``status_kind``
(a status claiming another kind); ``serves_config`` (also serve this config as a Gym
head server does, at ``GET /global_config_dict_yaml``); ``disabled`` (no control routes: not a participant).
``POST /run`` is a data route that parks until ``POST /test/release``.

The server listens on a socket the test bound and passed down (``fd``), so no port race.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from fastapi import Request  # at module level: FastAPI resolves the routes' string annotations here

from nemo_gym_checkpoint_plugin._control import Readiness
from nemo_gym_checkpoint_plugin._errors import ERRORS_BY_CODE
from nemo_gym_checkpoint_plugin._identity import from_capture_key
from nemo_gym_checkpoint_plugin._markers import hookimpl

CONTROL = "/ng-control/v1/checkpoint"
TOKEN = "coord-test-token"


class StubParticipant:
    """The in-test participant plugin: holds the episodes ``holds`` names, reports ``blockers``/``restarts``."""

    def __init__(self, spec: dict[str, Any], write_log: Any) -> None:
        self.spec = spec
        self.write_log = write_log
        self.installed: list[str] = []

    @hookimpl
    def ready(self, checkpoint_id: str | None) -> Readiness:
        return Readiness(
            blockers=list(self.spec.get("blockers", ())),
            restarts=list(self.spec.get("restarts", ())),
            counts={"held": len(self.spec.get("holds", ()))},
        )

    @hookimpl
    async def wait_ready(self, checkpoint_id: str) -> None:
        # A blocker never clears in this stub: the control plane cancels this at the deadline.
        await asyncio.Event().wait()

    @hookimpl
    def export(self, checkpoint_id: str, scope: frozenset[str] | None) -> list[dict[str, Any]]:
        code = self.spec.get("export_error")
        if code:
            raise ERRORS_BY_CODE[code](f"{self.spec['instance']} cannot export (test)")
        records = []
        for held in self.spec.get("holds", ()):
            if (scope is None or held in scope) and held not in self.spec.get("restarts", ()):
                episode = from_capture_key(held)
                records.append(
                    {
                        "episode_id": {"rollout_id": episode.rollout_id, "attempt": episode.attempt},
                        "owner": self.spec["instance"],
                        "step": 3,
                    }
                )
        return records

    @hookimpl
    def install(self, checkpoint_id: str, manifest: Any, records: list[Any]) -> None:
        self.installed = sorted(r.replacement.capture_key for r in records)

    @hookimpl
    def status_fields(self) -> dict[str, Any] | None:
        # An environment lists its episodes, as the built-in ones do (ng-checkpoint commit --all reads them).
        return {"episode_keys": sorted(self.spec.get("holds", ()))} if self.spec["kind"] == "environment" else None

    @hookimpl
    def retire(self, episode_ids: list[Any]) -> None:
        self.write_log(op="retired", keys=sorted(e.capture_key for e in episode_ids))


class ControlLog:
    """ASGI middleware in front of the real control routes: logs, barrier, injected faults.

    Logs each control call's arrival (with the raw body's digest) and the moment its reply
    starts; holds a call at the barrier; and, only where a test asks, answers for the real
    routes: ``hang`` (never reply), ``fail`` (a refusal with that code) or ``status_kind``
    (a status claiming another kind), standing in for a broken or foreign participant.
    """

    def __init__(self, app: Any, spec: dict[str, Any], write_log: Any) -> None:
        self.app, self.spec, self.write_log = app, spec, write_log

    async def barrier(self, operation: str) -> None:
        """Hold the call until ``count`` participants have received ``operation`` (bounded).

        A controller that sends the calls one after another never fills the barrier: each
        call then replies only at the bound, after the next one arrived late, and the
        test's "every call arrived before any reply" check fails.
        """
        count = self.spec.get("barrier", {}).get(operation)
        if not count:
            return
        directory = Path(self.spec["barrier_dir"])
        (directory / f"{operation}-{self.spec['instance']}").touch()
        deadline = time.monotonic() + 3.0
        while len(list(directory.glob(f"{operation}-*"))) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # wait-ok: polling interval for the barrier (bounded by its deadline)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(CONTROL + "/"):
            await self.app(scope, receive, send)
            return
        operation = scope["path"].rsplit("/", 1)[-1]
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        self.write_log(op=operation, event="arrive", sha=hashlib.sha256(body).hexdigest())
        await self.barrier(operation)
        if operation in self.spec.get("hang", ()):
            await asyncio.Event().wait()

        async def logged_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.write_log(op=operation, event="reply", status=message["status"])
            await send(message)

        injected = None
        if operation in self.spec.get("fail", {}):
            # A code, or [code, capture keys the refusal names] (attempt_running's episode_ids).
            code, *named = (
                [self.spec["fail"][operation]]
                if isinstance(self.spec["fail"][operation], str)
                else self.spec["fail"][operation]
            )
            error = ERRORS_BY_CODE[code](
                f"{self.spec['instance']} refuses {operation} (test)", episodes=named[0] if named else None
            )
            injected = (error.status, error.to_body())
        elif operation == "status" and "status_kind" in self.spec:
            injected = (200, {"kind": self.spec["status_kind"], "instance": self.spec["instance"], "phase": "idle"})
        if injected is not None:
            raw = orjson.dumps(injected[1])
            await logged_send(
                {
                    "type": "http.response.start",
                    "status": injected[0],
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": raw})
            return
        delivered = False

        async def replay() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, logged_send)


def build_app(spec: dict[str, Any]) -> Any:
    """A participant server: the real control plane and routes, with the in-test plugin."""
    from fastapi import FastAPI

    from nemo_gym_checkpoint_plugin._control import ControlPlane
    from nemo_gym_checkpoint_plugin._plugins import make_plugin_manager
    from nemo_gym_checkpoint_plugin._routes import attach
    from nemo_gym_checkpoint_plugin._settings import CheckpointSettings

    log = open(spec["log"], "ab", buffering=0)  # noqa: SIM115 - lives as long as the process

    def write_log(**entry: Any) -> None:
        log.write(orjson.dumps({"t": time.monotonic_ns(), **entry}) + b"\n")

    app = FastAPI()
    release = asyncio.Event()

    @app.get("/")
    async def root() -> dict[str, Any]:
        return {"ok": True}

    @app.post("/run")
    async def run(request: Request) -> dict[str, Any]:
        write_log(op="run", event="arrive")
        await release.wait()
        write_log(op="run", event="reply")
        return {"ok": True}

    if "serves_config" in spec:
        # A Gym head server: the resolved config, as JSON text (what ServerClient reads).
        @app.get("/global_config_dict_yaml")
        async def global_config() -> Any:
            from fastapi.responses import Response

            return Response(orjson.dumps(spec["serves_config"]), media_type="text/plain")

    @app.post("/test/release")
    async def test_release() -> dict[str, Any]:
        release.set()
        return {"released": True}

    if not spec.get("disabled"):
        # Without it the server is a Gym server running without checkpointing: control routes 404.
        pm = make_plugin_manager([StubParticipant(spec, write_log)], load_entry_points=False)
        settings = CheckpointSettings(enabled=True)
        plane = ControlPlane(pm, kind=spec["kind"], instance=spec["instance"], settings=settings)
        attach(app, plane, spec["token"])
        app.router.on_shutdown.append(plane.aclose)
    app.add_middleware(ControlLog, spec=spec, write_log=write_log)
    return app


def _die_with_parent(parent: int) -> None:
    """A test killed by a timeout must not leave participants behind: die with the parent (Linux)."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def serve() -> None:
    import uvicorn

    _die_with_parent(int(sys.argv[3]))

    spec = orjson.loads(os.environ["COORD_STUB"])
    uvicorn.run(build_app(spec), fd=int(sys.argv[2]), log_level="warning")


# -- the test side ------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    kind: str
    url: str
    log: Path
    process: subprocess.Popen
    spec: dict[str, Any] = field(default_factory=dict)

    def events(self) -> list[dict[str, Any]]:
        return [orjson.loads(line) for line in self.log.read_bytes().splitlines() if line]

    def first(self, op: str, event: str = "arrive") -> int:
        times = [e["t"] for e in self.events() if e["op"] == op and e.get("event") == event]
        assert times, f"{self.name} never logged {op} {event}"
        return times[0]

    def ops(self) -> list[str]:
        return [e["op"] for e in self.events() if e.get("event") == "arrive"]


def bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def wait_until_serving(url: str, process: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"participant at {url} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)  # wait-ok: polling interval while the server starts (bounded by the deadline)
    raise TimeoutError(f"participant at {url} did not serve within {timeout}s")


def start_participants(tmp: Path, specs: list[dict[str, Any]]) -> list[Server]:
    """Start one uvicorn process per spec (in parallel) and wait until each serves."""
    started = []
    for spec in specs:
        name = spec.setdefault("name", spec["instance"])
        spec.setdefault("token", TOKEN)
        spec["log"] = str(tmp / f"{name}.log.jsonl")
        Path(spec["log"]).touch()
        sock = bound_socket()
        port = sock.getsockname()[1]
        env = {**os.environ, "COORD_STUB": orjson.dumps(spec).decode(), "RAY_USAGE_STATS_ENABLED": "0"}
        process = subprocess.Popen(
            [sys.executable, __file__, "serve", str(sock.fileno()), str(os.getpid())],
            pass_fds=(sock.fileno(),),
            env=env,
            start_new_session=True,
        )
        sock.close()
        started.append(Server(name, spec["kind"], f"http://127.0.0.1:{port}", Path(spec["log"]), process, spec))
    try:
        for server in started:
            wait_until_serving(server.url, server.process)
    except BaseException:
        stop_participants(started)
        raise
    return started


def stop_participants(servers: list[Server]) -> None:
    for server in servers:
        if server.process.poll() is None:
            server.process.kill()
    for server in servers:
        server.process.wait(timeout=30)


def config_for(servers: list[Server], token_env: str = "COORD_TEST_TOKEN") -> dict[str, Any]:
    """A Gym-shaped config: a top-level block per server, each with host/port, plus the checkpoint block."""
    server_type = {
        "environment": "environment_servers",
        "model": "responses_api_models",
        "agent": "responses_api_agents",
        "resources": "resources_servers",
    }
    config: dict[str, Any] = {"checkpoint": {"enabled": True, "control_auth_token_env": token_env}}
    for server in servers:
        host, port = server.url.removeprefix("http://").split(":")
        config[server.name] = {
            server_type[server.kind]: {f"{server.name}_impl": {"entrypoint": "app.py", "host": host, "port": int(port)}}
        }
    return config


FOUR = [
    {"kind": "environment", "instance": "env"},
    {"kind": "model", "instance": "policy_model"},
    {"kind": "agent", "instance": "agent"},
    {"kind": "resources", "instance": "tools"},
]


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve()


def four_participants(tmp: Path) -> list[Server]:
    """``FOUR`` holding r1, r2-a1 and r3, the agent reporting r3 as a restart (the CLI tests' deployment)."""
    specs = [dict(spec, holds=["r1", "r2-a1", "r3"]) for spec in FOUR]
    specs[2]["restarts"] = ["r3"]
    return start_participants(tmp, specs)
