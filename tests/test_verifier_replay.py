"""The built-in declarations: the wheel's stateless verifiers, their ``/verify`` replayed on a recorded request.

Each verifier in ``checkpoint_modes.BUILTIN_MODES`` is built from its real class in process
(wrapped as a deployment wraps it) and served over ``httpx.ASGITransport``. The recorded
request is the wheel's own data: a task of ``data/example.jsonl`` with the model response
of the first line of ``data/example_rollouts.jsonl`` (the task it was recorded for). It is verified on one server, then
on a freshly built one (what a replay after a crash meets: a new process), then on the
first again: the reward, and the whole verify reply, are the same every time. The
resources participant of each class declares ``/verify`` replayable on every seed.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from nemo_gym.config_types import BaseServerConfig
from nemo_gym.server_utils import ServerClient
from nemo_gym_checkpoint_plugin.builtin_participants.resources.checkpoint_modes import BUILTIN_MODES, CheckpointMode
from nemo_gym_checkpoint_plugin.builtin_participants.resources.session_bindings import ResourcesSessions
from omegaconf import OmegaConf

from nemo_gym_checkpoint_plugin._identity import EpisodeId
from nemo_gym_checkpoint_plugin.wrap import derive_checkpointable

STATELESS = sorted(path for path, mode in BUILTIN_MODES.items() if mode is CheckpointMode.STATELESS)


def _class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _build(path: str) -> Any:
    server_class = derive_checkpointable(_class(path))
    config_cls = server_class.model_fields["config"].annotation
    config = config_cls.model_validate(
        {"host": "127.0.0.1", "port": 0, "entrypoint": "app.py", "name": f"replay_{server_class.__name__}"}
    )
    # No checkpoint block: the server is built exactly as Gym builds it, nothing attached.
    global_config = OmegaConf.create({"head_server": {"host": "127.0.0.1", "port": 0}})
    head = BaseServerConfig(host="127.0.0.1", port=0)
    client = ServerClient(head_server_config=head, global_config_dict=global_config)
    return server_class(config=config, server_client=client)


def _recorded_request(path: str) -> dict[str, Any]:
    data = Path(importlib.import_module(path.rpartition(".")[0]).__file__).parent / "data"
    tasks = [json.loads(line) for line in (data / "example.jsonl").read_text().splitlines() if line.strip()]
    with (data / "example_rollouts.jsonl").open() as rollouts:
        rollout = json.loads(rollouts.readline())
    index = rollout.get("_ng_task_index", 0)
    # ruler's recorded rollouts index a larger task file than the one shipped: its first task then.
    task = tasks[index] if index < len(tasks) else tasks[0]
    return {**task, "response": rollout["response"]}


async def _verify(server: Any, body: dict[str, Any]) -> dict[str, Any]:
    app = server.setup_webserver()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30.0) as http:
        reply = await http.post("/verify", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_at_least_five_builtin_stateless_verifiers() -> None:
    assert len(STATELESS) >= 5


@pytest.mark.parametrize("path", STATELESS)
async def test_verify_replays_to_the_same_reward(path: str) -> None:
    body = _recorded_request(path)
    first_server = _build(path)
    first = await _verify(first_server, body)
    replayed = await _verify(_build(path), body)
    again = await _verify(first_server, body)
    assert isinstance(first["reward"], float)
    assert first["reward"] == replayed["reward"] == again["reward"]
    assert first == replayed == again


@pytest.mark.parametrize("path", STATELESS)
def test_participant_declares_verify_replayable(path: str) -> None:
    sessions = ResourcesSessions(_build(path))
    assert sessions.mode is CheckpointMode.STATELESS and sessions.capturable
    declaration = sessions.seed_session(EpisodeId(rollout_id=f"r-{path}", attempt=0), {"task_data": None})
    assert declaration is not None and declaration.verify_replay and not declaration.restart
    assert sessions.ready(None).restarts == []


def test_a_subclass_is_not_covered_by_the_table() -> None:
    # A subclass may keep state of its own: it is undeclared, whatever its base.
    base = _class(STATELESS[0])
    derived = type("KeepsState", (base,), {"__module__": "acme.app"})
    server = _build(STATELESS[0])
    server.__class__ = derive_checkpointable(derived)
    assert ResourcesSessions(server).mode is None
