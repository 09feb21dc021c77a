"""Leftover retired marks and typed refusals during ``ng-checkpoint collect`` (issue 24), on real processes.

A restore or retire by hand leaves marks that refuse their rollouts' attempts (``stale_attempt``).
``collect`` reads them before it restores or dispatches anything and refuses, exit 2, naming the
rollouts and the ``forget`` command to run; that command, run as printed, clears them and the
collection then runs every row once. Any typed refusal a server answers during a collection
reaches Gym with its code and detail, never a bare ``409, message='Conflict'``.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from aiohttp import ClientResponseError
from controllers_support import TOKEN, Collector, collect_deployment, fake, rows_of
from nemo_gym import server_utils
from nemo_gym.server_utils import (
    BaseServerConfig,
    GlobalAIOHTTPAsyncClientConfig,
    raise_for_status,
    set_global_aiohttp_client,
)
from omegaconf import OmegaConf

from nemo_gym_checkpoint_plugin.coordination import discover
from nemo_gym_checkpoint_plugin.coordination._collection import CollectorServerClient, RunTracker
from nemo_gym_checkpoint_plugin.testing.gym_config import ENVIRONMENT, TOKEN_ENV, rollout_body

ROWS = 4


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Any:
    deployment = collect_deployment(tmp_path_factory.mktemp("marks"), ROWS)
    yield deployment
    deployment.stop()


async def _marks(deployment: Any) -> dict[str, int]:
    async with await discover(deployment.config, TOKEN) as coordinator:
        statuses, failures = await coordinator.status(timeout=30)
    assert not failures, failures
    return {name: status["retired_rollouts"] for name, status in statuses.items()}


@pytest.mark.slow
async def test_leftover_marks_are_refused_before_dispatch_naming_them_and_the_printed_forget_clears_them(
    deployment: Any, tmp_path: Path
) -> None:
    ckpt, output = tmp_path / "ckpt", tmp_path / "out.jsonl"
    # What a restore by hand leaves: rows 1 and 2 of this input retired (row 2 up to its attempt 1).
    async with await discover(deployment.config, TOKEN) as coordinator:
        await coordinator.retire("by-hand-1", ["1-0", "2-0-a1"], timeout=30)
    calls = fake(deployment, "stats")["calls_total"]
    refused = Collector(deployment, tmp_path, "refused", ckpt=ckpt, output=output)
    assert await asyncio.to_thread(refused.wait) == 2, refused.text()[-3000:]
    text = refused.text()
    assert "1-0 (attempts up to 0)" in text and "2-0 (attempts up to 1)" in text, text[-3000:]
    assert "nothing was restored or dispatched" in text
    # Before any row: no model call, no output, and the deployment is given back (the forget below needs no take-over).
    assert fake(deployment, "stats")["calls_total"] == calls and not output.exists()
    (command,) = re.findall(r"Remove them first: (ng-checkpoint forget .*?)$", text, re.MULTILINE)
    argv = shlex.split(command)
    assert argv[argv.index("--rollout") :] == ["--rollout", "1-0", "--rollout", "2-0"]
    forgot = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "nemo_gym_checkpoint_plugin.cli", *argv[1:]],
        env={**os.environ, TOKEN_ENV: TOKEN},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert forgot.returncode == 0, forgot.stderr
    assert set((await _marks(deployment)).values()) == {0}
    done = Collector(deployment, tmp_path, "after-forget", ckpt=ckpt, output=output)
    assert await asyncio.to_thread(done.wait) == 0, done.text()[-3000:]
    assert rows_of(output) == {i: 1 for i in range(ROWS)}


async def _post_run(deployment: Any, body: dict[str, Any]) -> ClientResponseError:
    """``/run`` through the collector's client to the real environment, read as Gym reads it."""
    where = urlsplit(deployment.urls[ENVIRONMENT])
    server = {"host": where.hostname, "port": where.port}
    config = OmegaConf.create({"env": {"environment_servers": {"single_agent_turn": server}}})
    client = CollectorServerClient(head_server_config=BaseServerConfig(**server), global_config_dict=config)
    # Gym's shared aiohttp client, made on this loop (Gym would make it from its global config, i.e. sys.argv).
    set_global_aiohttp_client(cfg=GlobalAIOHTTPAsyncClientConfig())
    try:
        response = await client.track(RunTracker()).post(server_name="env", url_path="/run", json=body)
        with pytest.raises(ClientResponseError) as caught:
            await raise_for_status(response)  # Gym's own reading of a failed reply
        return caught.value
    finally:
        await server_utils._GLOBAL_AIOHTTP_CLIENT.close()
        server_utils._GLOBAL_AIOHTTP_CLIENT = None


@pytest.mark.slow
async def test_a_refusal_during_a_collection_reaches_gym_with_its_code_and_detail(deployment: Any) -> None:
    async with await discover(deployment.config, TOKEN) as coordinator:
        await coordinator.retire("by-hand-2", ["r-stale-a1"], timeout=30)
        try:
            body = rollout_body("r-stale", attempt=1)
            error = await _post_run(deployment, body)
        finally:
            await coordinator.forget("by-hand-2", ["r-stale"], timeout=30)
    assert error.status == 409
    assert error.message.startswith("stale_attempt: ") and "r-stale" in error.message, error.message
    assert "stale_attempt: attempt 1 of rollout 'r-stale'" in str(error) and "Conflict" not in str(error)
    # Gym's failure row keeps the body: the code and detail reach the failures sidecar too.
    assert b'"stale_attempt"' in error.response_content
