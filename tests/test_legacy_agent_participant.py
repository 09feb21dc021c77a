"""The ``legacy_agent`` relay as an environment participant: every relayed episode is a restart.

In process: the wheel's real ``LegacyAgentEnvironmentServer`` class, derived by the wrapper
(``derive_checkpointable``) and built as Gym builds it, its app served through ASGI with
the real control routes and gate. Its agent is a fake ``ServerClient`` that holds each
relayed ``/run`` until the test releases it, and records cancellations.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from control_support import wait_until
from environment_servers.legacy_agent.app import LegacyAgentEnvironmentServer, LegacyAgentEnvironmentServerConfig
from gym_fakes import FakeReply
from nemo_gym.config_types import AgentServerRef
from nemo_gym.server_utils import BaseServerConfig, ServerClient
from nemo_gym_checkpoint_plugin.builtin_participants import checkpointable_bases
from nemo_gym_checkpoint_plugin.builtin_participants.environment.relay import LegacyAgentRelay, relayed_episode_id
from omegaconf import OmegaConf
from pydantic import ConfigDict

from nemo_gym_checkpoint_plugin._attach import ATTACHMENT_STATE
from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin._types import RestoredRecord, plain_records
from nemo_gym_checkpoint_plugin.testing.gym_config import DEFAULT_CHECKPOINT_BLOCK, TOKEN_ENV
from nemo_gym_checkpoint_plugin.testing.harness import (
    HARNESS_TOKEN,
    GymHarness,
    wait_until_async,
)
from nemo_gym_checkpoint_plugin.wrap import derive_checkpointable

TOKEN = "legacy-relay-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CONTROL = "/ng-control/v1/checkpoint"


_JSON = {"content-type": "application/json"}


@pytest.fixture(autouse=True)
def _token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)


class FakeAgent(ServerClient):
    """The agent side of the relay: each ``/run`` waits for its rollout to be released."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    started: list[str]
    cancelled: list[str]
    release: dict[str, asyncio.Event]

    async def post(self, server_name: str, url_path: str, **kwargs: Any) -> FakeReply:
        assert (server_name, url_path) == ("agent", "/run")
        key = str(orjson.loads(kwargs["data"]).get("_ng_rollout_id", "unnamed"))
        self.started.append(key)
        event = self.release.setdefault(key, asyncio.Event())
        try:
            await event.wait()
        except asyncio.CancelledError:
            self.cancelled.append(key)
            raise
        return FakeReply({"reward": 1.0, "rollout": key})


def _server(checkpoint: Any = DEFAULT_CHECKPOINT_BLOCK) -> tuple[Any, Any, FakeAgent]:
    derived = derive_checkpointable(LegacyAgentEnvironmentServer)
    config = LegacyAgentEnvironmentServerConfig(
        name="legacy_env",
        host="127.0.0.1",
        port=1,
        entrypoint="app.py",
        agent_server=AgentServerRef(type="responses_api_agents", name="agent"),
    )
    global_config = OmegaConf.create({} if checkpoint is None else {"checkpoint": dict(checkpoint)})
    head = BaseServerConfig(host="127.0.0.1", port=1)
    server = derived(
        config=config, server_client=ServerClient(head_server_config=head, global_config_dict=global_config)
    )
    app = server.setup_webserver()
    server.setup_liveness(app)
    agent = FakeAgent(head_server_config=head, global_config_dict=global_config, started=[], cancelled=[], release={})
    # After setup: the attachment swapped in the plugin's client, the relay now reaches the fake agent.
    server.server_client = agent
    return server, app, agent


def _asgi(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=10.0)


def _row(rollout_id: str, attempt: int = 0) -> dict[str, Any]:
    return {"responses_create_params": {"input": "task"}, "_ng_rollout_id": rollout_id, "_ng_attempt_index": attempt}


def _deadline() -> float:
    return time.time() + 10.0


def test_the_wrapper_derives_the_relay_and_checkpointing_off_installs_nothing() -> None:
    assert checkpointable_bases(LegacyAgentEnvironmentServer) == (LegacyAgentRelay,)
    assert LegacyAgentRelay in derive_checkpointable(LegacyAgentEnvironmentServer).__mro__
    server, app, _ = _server(checkpoint=None)
    assert server._ng_relay_book is None
    assert getattr(app.state, ATTACHMENT_STATE, None) is None


def test_the_episode_is_named_by_the_legacy_row_or_an_episode_id() -> None:
    assert relayed_episode_id(orjson.dumps(_row("r", 2))) == EpisodeId(rollout_id="r", attempt=2)
    assert relayed_episode_id(orjson.dumps({"_ng_task_index": 3, "_ng_rollout_index": 1})) == EpisodeId(
        rollout_id="3-1", attempt=0
    )
    wire = {"episode_id": {"rollout_id": "e", "attempt": 1}}
    assert relayed_episode_id(orjson.dumps(wire)) == EpisodeId(rollout_id="e", attempt=1)
    assert relayed_episode_id(b"not json") is None
    assert relayed_episode_id(orjson.dumps({"responses_create_params": {}})) is None
    assert relayed_episode_id(orjson.dumps({"_ng_rollout_id": "bad id!"})) is None


async def test_relays_in_flight_are_restarts_never_block_never_export_and_run_through_the_checkpoint(
    tmp_path: Path,
) -> None:
    server, app, agent = _server()
    book = server._ng_relay_book
    keys = [f"r{i}" for i in range(120)]  # more than the 100 blockers a report lists: restarts are never capped
    async with _asgi(app) as http:
        runs = {key: asyncio.ensure_future(http.post("/run", json=_row(key))) for key in keys}
        await wait_until(lambda: len(agent.started) == len(keys), what="every relay reached the agent")

        prepare = await http.post(
            f"{CONTROL}/prepare", headers=AUTH, json={"checkpoint_id": "c1", "deadline_ts": _deadline()}
        )
        assert prepare.status_code == 200, prepare.text
        report = prepare.json()["report"]
        assert sorted(report["restarts"]) == sorted(keys)
        assert report["blockers"] == []

        # A new /run parks at the gate; the relays already in flight keep running and may finish.
        parked = asyncio.ensure_future(http.post("/run", json=_row("late")))
        gate = getattr(app.state, ATTACHMENT_STATE).gate_counters
        await wait_until(lambda: gate.parked == 1, what="the new /run parked at the gate")
        agent.release["r0"].set()
        finished = await runs.pop("r0")
        assert finished.status_code == 200 and finished.json() == {"reward": 1.0, "rollout": "r0"}
        assert "late" not in agent.started

        in_scope = await http.post(
            f"{CONTROL}/commit",
            headers=AUTH,
            json={
                "checkpoint_id": "c1",
                "deadline_ts": _deadline(),
                "checkpoint_dir": str(tmp_path / "ckpt"),
                "episode_ids": [{"rollout_id": "r1", "attempt": 0}],
            },
        )
        assert in_scope.status_code == 409
        assert in_scope.json()["error"]["code"] == "restart_in_scope"

        assert plain_records(book.export("c1", None).records) == []  # never exported

        resume = await http.post(
            f"{CONTROL}/resume", headers=AUTH, json={"checkpoint_id": "c1", "deadline_ts": _deadline()}
        )
        assert resume.status_code == 200, resume.text
        await wait_until(lambda: "late" in agent.started, what="the parked /run was relayed after resume")
        await wait_until(lambda: "late" in book.ready(None).restarts, what="the late relay is a restart")
        for event in [agent.release.setdefault(key, asyncio.Event()) for key in [*runs, "late"]]:
            event.set()
        replies = await asyncio.gather(*runs.values(), parked)
        assert all(reply.status_code == 200 for reply in replies)
        assert book.ready(None).restarts == [] and agent.cancelled == []


async def test_retire_stops_the_relay_waits_for_it_then_the_attempt_is_refused() -> None:
    _, app, agent = _server()
    async with _asgi(app) as http:
        run = asyncio.ensure_future(http.post("/run", json=_row("r")))
        other = asyncio.ensure_future(http.post("/run", json=_row("s")))
        await wait_until(lambda: sorted(agent.started) == ["r", "s"], what="both relays reached the agent")

        retire = await http.post(
            f"{CONTROL}/retire",
            headers=AUTH,
            json={
                "checkpoint_id": "c-retire",
                "deadline_ts": _deadline(),
                "episode_ids": [{"rollout_id": "r", "attempt": 0}],
            },
        )
        assert retire.status_code == 200, retire.text
        # Retire returned only after the relay ended: the agent call was already cancelled.
        assert agent.cancelled == ["r"]
        stopped = await run
        assert stopped.status_code == 409 and stopped.json()["error"]["code"] == "stale_attempt"

        again = await http.post("/run", json=_row("r"))
        assert again.status_code == 409 and again.json()["error"]["code"] == "stale_attempt"
        assert agent.started.count("r") == 1  # refused before anything was relayed

        agent.release["s"].set()
        assert (await other).status_code == 200  # a relay not named keeps running
        agent.release["r"] = asyncio.Event()
        agent.release["r"].set()
        next_attempt = await http.post("/run", json=_row("r", 1))
        assert next_attempt.status_code == 200, next_attempt.text


async def test_a_retired_legacy_row_is_refused_at_the_gate_even_while_a_checkpoint_holds_admission() -> None:
    server, app, agent = _server()
    async with _asgi(app) as http:
        body = {
            "checkpoint_id": "c-retire",
            "deadline_ts": _deadline(),
            "episode_ids": [{"rollout_id": "r", "attempt": 0}],
        }
        assert (await http.post(f"{CONTROL}/retire", headers=AUTH, json=body)).status_code == 200
        prepare = await http.post(
            f"{CONTROL}/prepare", headers=AUTH, json={"checkpoint_id": "c1", "deadline_ts": _deadline()}
        )
        assert prepare.status_code == 200 and prepare.json()["phase"] == "prepared", prepare.text
        # The row names attempt 0 of r only through its legacy fields: refused at once, never parked.
        refused = await asyncio.wait_for(http.post("/run", json=_row("r")), timeout=5)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "stale_attempt"
        assert agent.started == []
        # The next attempt is not retired: it parks until the checkpoint resumes, then relays.
        gate = getattr(app.state, ATTACHMENT_STATE).gate_counters
        parked = asyncio.ensure_future(http.post("/run", json=_row("r", 1)))
        await wait_until(lambda: gate.parked == 1, what="the next attempt parked at the gate")
        assert gate.refused == 1
        resume = await http.post(
            f"{CONTROL}/resume", headers=AUTH, json={"checkpoint_id": "c1", "deadline_ts": _deadline()}
        )
        assert resume.status_code == 200
        await wait_until(lambda: agent.started == ["r"], what="the next attempt relayed after resume")
        agent.release["r"].set()
        assert (await parked).status_code == 200


async def test_a_relay_entering_while_admission_is_closed_waits_unrelayed_and_is_not_yet_a_restart() -> None:
    server, app, agent = _server()
    book = server._ng_relay_book
    async with _asgi(app) as http:
        # It passed the gate just before the checkpoint closed the book: the book alone is closed here.
        book.close_admission("c1")
        run = asyncio.ensure_future(http.post("/run", json=_row("r")))
        await wait_until(lambda: book.ready("c1").counts["parked"] == 1, what="the relay waits in the handler")
        assert agent.started == []
        assert book.ready("c1").restarts == []  # the prepare's restarts cannot change before its commit
        (record,) = plain_records(book.export("c1", None).records)
        assert record["boundary"] is None  # nothing relayed yet: it starts over from its input
        book.open_admission("c1")
        await wait_until(lambda: agent.started == ["r"], what="relayed once admission reopened")
        assert book.ready(None).restarts == ["r"]
        agent.release["r"].set()
        assert (await run).status_code == 200


async def test_an_unnamed_body_is_refused_rollout_id_required_and_a_duplicate_attempt_is_refused() -> None:
    server, app, agent = _server()
    book = server._ng_relay_book
    async with _asgi(app) as http:
        # A row naming no episode (no rollout id, no indices): agent work nobody could retire or
        # restart, so it is refused instead of relayed untracked (silently absent from checkpoints).
        for encoding in ("utf-8", "utf-16"):
            unnamed = await http.post("/run", content='{"responses_create_params": {}}'.encode(encoding), headers=_JSON)
            assert unnamed.status_code == 400, unnamed.text
            assert unnamed.json()["error"]["code"] == "rollout_id_required"
        assert agent.started == [] and book.ready(None).counts["episodes"] == 0
        first = asyncio.ensure_future(http.post("/run", json=_row("d")))
        await wait_until(lambda: agent.started.count("d") == 1, what="the first relay started")
        duplicate = await http.post("/run", json=_row("d"))
        assert duplicate.status_code == 409 and duplicate.json()["error"]["code"] == "attempt_running"
        assert book.ready(None).restarts == ["d"]
        agent.release["d"].set()
        assert (await first).status_code == 200


def test_install_accepts_only_records_without_a_boundary() -> None:
    server, _, _ = _server()
    book = server._ng_relay_book
    checkpointed = EpisodeId(rollout_id="r", attempt=0)
    replacement = EpisodeId(rollout_id="r", attempt=1)

    def record(boundary: str | None) -> RestoredRecord:
        return RestoredRecord(
            checkpointed=checkpointed,
            replacement=replacement,
            record={"episode_id": {"rollout_id": "r", "attempt": 0}, "boundary": boundary, "state": {}},
        )

    with pytest.raises(ValueError, match="no boundaries"):
        book.install("c1", {}, [record("seeded")])
    assert book.restored_pending() == []
    book.install("c1", {}, [record(None)])
    assert book.restored_pending() == ["r-a1"]


# -- process level: the real deployment's simple_agent behind a wrapped legacy_agent process --------------


def _legacy_process(deployment: Any, port: int, log: Path) -> subprocess.Popen[bytes]:
    """Start ``legacy_env`` (the wheel's legacy_agent through the wrapper) relaying to the deployment's agent."""
    from nemo_gym import _resolve_under_cwd_or_install

    from nemo_gym_checkpoint_plugin.testing.gym_config import AGENT, HOST, WRAP_ENTRYPOINT

    block = {
        "legacy_env": {
            "environment_servers": {
                "legacy_agent": {
                    "host": HOST,
                    "port": port,
                    "entrypoint": WRAP_ENTRYPOINT,
                    "agent_server": {"type": "responses_api_agents", "name": AGENT},
                }
            }
        }
    }
    config = OmegaConf.merge(deployment.config, OmegaConf.create(block))
    server_dir = _resolve_under_cwd_or_install(
        Path("environment_servers", "legacy_agent"), validator=lambda d: (d / "requirements.txt").exists()
    )
    env = {
        **os.environ,
        **deployment.extra_env,
        "NEMO_GYM_CONFIG_DICT": OmegaConf.to_yaml(config),
        "NEMO_GYM_CONFIG_PATH": "legacy_env",
        "PYTHONPATH": os.pathsep.join(p for p in (str(server_dir), os.environ.get("PYTHONPATH")) if p),
        "RAY_USAGE_STATS_ENABLED": "0",
        "NO_PROXY": f"{HOST},localhost",
        "no_proxy": f"{HOST},localhost",
    }
    with open(log, "ab") as out:
        return subprocess.Popen(
            (sys.executable, "-m", WRAP_ENTRYPOINT),
            cwd=server_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.mark.slow
async def test_process_level_relay_to_simple_agent_is_a_restart_refused_in_scope_and_retired(
    gym_deployment: GymHarness, tmp_path: Path
) -> None:
    from nemo_gym_checkpoint_plugin.testing.deployment import free_port_base
    from nemo_gym_checkpoint_plugin.testing.gym_config import rollout_body

    port = free_port_base(span=1)
    proc = _legacy_process(gym_deployment.deployment, port, tmp_path / "legacy_env.log")
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {HARNESS_TOKEN}"}
    rid = "legacy-relay"
    row = {
        "responses_create_params": rollout_body(rid)["task"]["task_input"]["responses_create_params"],
        "_ng_rollout_id": rid,
    }
    fake = gym_deployment.fake
    try:
        async with httpx.AsyncClient(timeout=60.0, trust_env=False) as http:

            async def ready() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"legacy_env exited: {(tmp_path / 'legacy_env.log').read_text()[-3000:]}")
                try:
                    return (await http.get(url + "/readyz")).status_code == 200
                except httpx.TransportError:
                    return False

            await wait_until_async(ready, 60, "legacy_env ready")
            await fake.hold(match=f"(rollout {rid})", count=1, step=1)
            run = asyncio.ensure_future(http.post(url + "/run", json=row))
            await fake.wait_for(lambda s: s["held"] == 1, timeout=60, what="the relayed run held at the model")

            def control(op: str, **body: Any) -> Any:
                return http.post(f"{url}{CONTROL}/{op}", headers=auth, json={"deadline_ts": _deadline(), **body})

            prepare = await control("prepare", checkpoint_id="p1")
            assert prepare.status_code == 200, prepare.text
            assert prepare.json()["report"]["restarts"] == [rid]
            assert prepare.json()["report"]["blockers"] == []
            scope = [{"rollout_id": rid, "attempt": 0}]
            commit = await control("commit", checkpoint_id="p1", checkpoint_dir=str(tmp_path / "c"), episode_ids=scope)
            assert commit.status_code == 409 and commit.json()["error"]["code"] == "restart_in_scope"
            assert (await control("resume", checkpoint_id="p1")).status_code == 200
            assert not run.done()  # the relay ran through the checkpoint, still held at the model

            retire = await control("retire", checkpoint_id="r1", episode_ids=scope)
            assert retire.status_code == 200, retire.text
            stopped = await asyncio.wait_for(run, 30)
            assert stopped.status_code == 409 and stopped.json()["error"]["code"] == "stale_attempt"
            again = await http.post(url + "/run", json=row)
            assert again.status_code == 409 and again.json()["error"]["code"] == "stale_attempt"
            status = (await http.get(f"{url}{CONTROL}/status", headers=auth)).json()
            assert (status["kind"], status["episodes"], status["retired_rollouts"]) == ("environment", 0, 1)
    finally:
        await fake.release()
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
