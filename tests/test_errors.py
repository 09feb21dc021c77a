from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from nemo_gym_checkpoint_plugin import _errors as errors

# docs/protocol.md's error table: code -> status.
PROTOCOL_ERRORS = {
    "unauthorized": 401,
    "stale_checkpoint": 409,
    "checkpoint_conflict": 409,
    "invalid_phase": 409,
    "deadline_exceeded": 409,
    "stale_attempt": 409,
    "restart_in_scope": 409,
    "export_failed": 409,
    "checkpoint_parked": 409,
    "rollout_id_required": 400,
    "attempt_running": 409,
    "task_mismatch": 409,
    "ambiguous_episode_id": 422,
    "invalid_run_request": 422,
    "owner_conflict": 409,
    "owner_fenced": 409,
    "coordinator_unreachable": 503,
    "invalid_checkpoint_state": 422,
}


def test_one_class_per_protocol_code() -> None:
    assert {code: cls.status for code, cls in errors.ERRORS_BY_CODE.items()} == PROTOCOL_ERRORS
    for cls in errors.ERRORS_BY_CODE.values():
        assert issubclass(cls, errors.CheckpointError)
        assert cls.__doc__, f"{cls.__name__} must say when it is raised"


@pytest.mark.parametrize("code", sorted(PROTOCOL_ERRORS))
async def test_handler_renders_code_detail_and_status(code: str) -> None:
    app = FastAPI()
    errors.install_error_handler(app)

    @app.get("/boom")
    async def boom() -> None:
        raise errors.ERRORS_BY_CODE[code](f"why {code}", episode="r-a1")

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        reply = await client.get("/boom")
    assert reply.status_code == PROTOCOL_ERRORS[code]
    assert reply.json() == {"error": {"code": code, "detail": f"why {code}"}}


def test_error_keeps_its_data() -> None:
    exc = errors.InvalidCheckpointState("bad record", episode="r-a2")
    assert exc.data == {"episode": "r-a2"} and str(exc) == "bad record"


async def test_attempt_running_names_the_attempts_that_live_elsewhere() -> None:
    app = FastAPI()
    errors.install_error_handler(app)

    @app.get("/boom")
    async def boom() -> None:
        raise errors.AttemptRunning("r-a1 runs here", episodes=["r-a1", "q"])

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        reply = await client.get("/boom")
    assert reply.status_code == 409
    assert reply.json() == {
        "error": {"code": "attempt_running", "detail": "r-a1 runs here", "episode_ids": ["q", "r-a1"]}
    }
