"""Participant servers for coordination and CLI tests: real uvicorn processes on 127.0.0.1.

``StubParticipant`` serves PROTOCOL.md's control routes with a small phase machine,
writes and reads real checkpoints through the storage package, and logs every
control call's arrival and reply (CLOCK_MONOTONIC, shared by every process on the
machine) with a digest of the raw body, so tests observe the coordination order and
the bytes each participant received from the participant's own log.

Behaviour comes from a JSON spec in ``COORD_STUB``:
``kind``, ``instance``, ``token``, ``log`` (path), ``holds`` (capture keys it would
export), ``restarts``, ``blockers`` (a prepare with blockers waits for its deadline and
replies ``preparing``), ``fail`` ({operation: error code}), ``hang`` (operations that
never reply), ``disabled`` (no control routes: not a participant), ``status_kind``
(the kind ``status`` claims), ``barrier`` ({operation: count}, with ``barrier_dir``: hold
the call until that many participants received it, so "sent at once" is observable
without racing). ``POST /run`` is a data route that parks until ``POST /test/release``.

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

CONTROL = "/ng-control/v1/checkpoint"
TOKEN = "coord-test-token"


def build_app(spec: dict[str, Any]) -> Any:
    from fastapi import FastAPI
    from pydantic import BaseModel, ConfigDict

    from nemo_gym_checkpoint_plugin.errors import (
        ERRORS_BY_CODE,
        CheckpointConflict,
        InvalidPhase,
        StaleCheckpoint,
        Unauthorized,
        install_error_handler,
    )
    from nemo_gym_checkpoint_plugin.storage import CheckpointWriter, read_checkpoint

    app = FastAPI()
    install_error_handler(app)
    kind, instance = spec["kind"], spec["instance"]
    log = open(spec["log"], "ab", buffering=0)  # noqa: SIM115 - lives as long as the process
    state: dict[str, Any] = {"phase": "idle", "checkpoint_id": None, "resumed": [], "marks": {}, "lease": None}
    release = asyncio.Event()

    class Body(BaseModel):
        model_config = ConfigDict(extra="forbid")
        checkpoint_id: str
        deadline_ts: float
        checkpoint_dir: str | None = None
        episode_ids: list[dict[str, Any]] | None = None
        rollout_ids: list[str] | None = None
        stop: bool = False

    def key(episode: dict[str, Any]) -> str:
        return episode["rollout_id"] if episode["attempt"] == 0 else f"{episode['rollout_id']}-a{episode['attempt']}"

    def write_log(**entry: Any) -> None:
        log.write(orjson.dumps({"t": time.monotonic_ns(), **entry}) + b"\n")

    async def enter(request: Request, operation: str) -> Body | None:
        raw = await request.body()
        write_log(op=operation, event="arrive", sha=hashlib.sha256(raw).hexdigest())
        if request.headers.get("authorization") != f"Bearer {spec['token']}":
            raise Unauthorized("missing or wrong bearer token")
        await barrier(operation)
        if operation in spec.get("hang", ()):
            await asyncio.Event().wait()
        if operation in spec.get("fail", {}):
            code = spec["fail"][operation]
            raise ERRORS_BY_CODE[code](f"{instance} refuses {operation} (test)")
        if operation == "status":
            return None
        body = Body.model_validate_json(raw)
        if body.checkpoint_id in state["resumed"] and operation != "resume":
            raise StaleCheckpoint(f"{body.checkpoint_id} was resumed")
        state["lease"] = body.deadline_ts + 600
        return body

    async def barrier(operation: str) -> None:
        """Hold the call until ``count`` participants have received ``operation`` (bounded).

        A controller that sends the calls one after another never fills the barrier: each
        call then replies only at the bound, after the next one arrived late, and the
        test's "every call arrived before any reply" check fails.
        """
        count = spec.get("barrier", {}).get(operation)
        if not count:
            return
        directory = Path(spec["barrier_dir"])
        (directory / f"{operation}-{instance}").touch()
        deadline = time.monotonic() + 3.0
        while len(list(directory.glob(f"{operation}-*"))) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # wait-ok: polling interval for the barrier (bounded by its deadline)

    def reply(operation: str, value: dict[str, Any]) -> dict[str, Any]:
        write_log(op=operation, event="reply")
        return value

    def report() -> dict[str, Any]:
        blockers = list(spec.get("blockers", ()))
        return {"ready": not blockers, "blockers": blockers[:100], "blocker_count": len(blockers),
                "counts": {"held": len(spec.get("holds", ()))}, "restarts": list(spec.get("restarts", ()))}

    def activate(checkpoint_id: str, phases: tuple[str, ...]) -> None:
        if state["phase"] not in phases:
            raise InvalidPhase(f"{instance} is {state['phase']}")
        if state["checkpoint_id"] not in (None, checkpoint_id):
            raise CheckpointConflict(f"{state['checkpoint_id']} is active")
        state["checkpoint_id"] = checkpoint_id

    @app.get("/")
    async def root() -> dict[str, Any]:
        return {"ok": True}

    if spec.get("disabled"):
        # A Gym server running without checkpointing: no control routes at all (404).
        return app

    @app.get(f"{CONTROL}/status")
    async def status(request: Request) -> dict[str, Any]:
        await enter(request, "status")
        return reply("status", {
            "kind": spec.get("status_kind", kind), "instance": instance, "phase": state["phase"],
            "checkpoint_id": state["checkpoint_id"], "lease_expires_at": state["lease"],
            "retired_rollouts": len(state["marks"]), "report": report(),
        })

    @app.post(f"{CONTROL}/prepare")
    async def prepare(request: Request) -> dict[str, Any]:
        body = await enter(request, "prepare")
        activate(body.checkpoint_id, ("idle", "preparing", "prepared"))
        state["phase"] = "preparing"
        if spec.get("blockers"):
            # A blocker never clears in this stub: wait for the deadline like a real participant would.
            await asyncio.sleep(max(body.deadline_ts - time.time(), 0))  # wait-ok: the deadline is the condition
            return reply("prepare", {"phase": "preparing", "report": report()})
        state["phase"] = "prepared"
        return reply("prepare", {"phase": "prepared", "report": report()})

    @app.post(f"{CONTROL}/renew")
    async def renew(request: Request) -> dict[str, Any]:
        await enter(request, "renew")
        return reply("renew", {"lease_expires_at": state["lease"]})

    @app.post(f"{CONTROL}/commit")
    async def commit(request: Request) -> dict[str, Any]:
        body = await enter(request, "commit")
        activate(body.checkpoint_id, ("prepared", "committed"))
        scope = None if body.episode_ids is None else {key(e) for e in body.episode_ids}
        from nemo_gym_checkpoint_plugin.identity import from_capture_key

        records = []
        for held in spec.get("holds", ()):
            if scope is None or held in scope:
                episode = from_capture_key(held)
                records.append({"episode_id": {"rollout_id": episode.rollout_id, "attempt": episode.attempt},
                                "owner": instance, "step": 3})
        writer = CheckpointWriter(body.checkpoint_dir, kind, instance, body.checkpoint_id)
        manifest = await asyncio.to_thread(writer.write, records)
        state["phase"] = "committed"
        keys = sorted(key(r["episode_id"]) for r in records)
        return reply("commit", {"phase": "committed", "manifest": manifest, "episode_ids": keys})

    @app.post(f"{CONTROL}/restore")
    async def restore(request: Request) -> dict[str, Any]:
        body = await enter(request, "restore")
        activate(body.checkpoint_id, ("idle",))
        scope = {key(e) for e in body.episode_ids or ()}
        for episode in body.episode_ids or ():
            marks = state["marks"]
            marks[episode["rollout_id"]] = max(marks.get(episode["rollout_id"], -1), episode["attempt"])
        restored = await asyncio.to_thread(read_checkpoint, body.checkpoint_dir, kind, instance, scope=scope)
        state["phase"] = "restored"
        keys = sorted(
            key({"rollout_id": r["episode_id"]["rollout_id"], "attempt": r["episode_id"]["attempt"] + 1})
            for r in restored.records
        )
        return reply("restore", {"phase": "restored", "source_checkpoint_id": restored.manifest["checkpoint_id"],
                                 "restored": keys})

    @app.post(f"{CONTROL}/resume")
    async def resume(request: Request) -> dict[str, Any]:
        body = await enter(request, "resume")
        idempotent = body.checkpoint_id in state["resumed"] or state["checkpoint_id"] is None
        if state["checkpoint_id"] not in (None, body.checkpoint_id):
            raise CheckpointConflict(f"{state['checkpoint_id']} is active")
        state.update(phase="idle", checkpoint_id=None)
        state["resumed"] = (state["resumed"] + [body.checkpoint_id])[-64:]
        return reply("resume", {"phase": "idle", "idempotent": idempotent})

    @app.post(f"{CONTROL}/retire")
    async def retire(request: Request) -> dict[str, Any]:
        body = await enter(request, "retire")
        if state["phase"] not in ("idle", "restored"):
            raise InvalidPhase(f"retire refused while {state['phase']}")
        if state["phase"] == "restored" and body.checkpoint_id != state["checkpoint_id"]:
            raise CheckpointConflict(f"retire must name the restore {state['checkpoint_id']}")
        for episode in body.episode_ids or ():
            marks = state["marks"]
            marks[episode["rollout_id"]] = max(marks.get(episode["rollout_id"], -1), episode["attempt"])
        write_log(op="retired", keys=sorted(key(e) for e in body.episode_ids or ()))
        return reply("retire", {"retired_count": len(body.episode_ids or ())})

    @app.post(f"{CONTROL}/forget")
    async def forget(request: Request) -> dict[str, Any]:
        body = await enter(request, "forget")
        for rollout in body.rollout_ids or ():
            state["marks"].pop(rollout, None)
        return reply("forget", {"forgotten_count": len(body.rollout_ids or ())})

    @app.post("/run")
    async def run(request: Request) -> dict[str, Any]:
        write_log(op="run", event="arrive")
        await release.wait()
        return reply("run", {"ok": True})

    @app.post("/test/release")
    async def test_release() -> dict[str, Any]:
        release.set()
        return {"released": True}

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
            pass_fds=(sock.fileno(),), env=env, start_new_session=True,
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
    server_type = {"environment": "environment_servers", "model": "responses_api_models",
                   "agent": "responses_api_agents", "resources": "resources_servers"}
    config: dict[str, Any] = {"checkpoint": {"enabled": True, "control_auth_token_env": token_env}}
    for server in servers:
        host, port = server.url.removeprefix("http://").split(":")
        config[server.name] = {server_type[server.kind]: {f"{server.name}_impl": {
            "entrypoint": "app.py", "host": host, "port": int(port)}}}
    return config


FOUR = [
    {"kind": "environment", "instance": "env"},
    {"kind": "model", "instance": "policy_model"},
    {"kind": "agent", "instance": "agent"},
    {"kind": "resources", "instance": "tools"},
]


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve()
