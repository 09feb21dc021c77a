"""``ng-checkpoint`` and the owner lease: refused naming the owner, the take-over, status, release on resume."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import orjson
import pytest
from coord_support import TOKEN, four_participants, stop_participants

from nemo_gym_checkpoint_plugin.coordination import CoordinationError, discover

pytestmark = pytest.mark.slow

NG_CHECKPOINT = [sys.executable, "-m", "nemo_gym_checkpoint_plugin.cli"]
TOKEN_ENV = "COORD_CLI_TOKEN"
COLLECTOR = "collect-0a1b2c3d@somewhere"


@pytest.fixture
def four(tmp_path):
    servers = four_participants(tmp_path)
    yield servers
    stop_participants(servers)


async def cli(servers, *args: str) -> subprocess.CompletedProcess:
    # In a thread: the event loop keeps running, so the collector's pooled connections see the servers close
    # them when idle (a loop blocked for seconds would reuse a connection the server already closed).
    return await asyncio.to_thread(_cli, servers, *args)


def _cli(servers, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("NG_CHECKPOINT_TOKEN", "NG_CHECKPOINT_CONFIG")}
    where = [arg for s in servers for arg in ("--url", s.url)]
    return subprocess.run(
        [*NG_CHECKPOINT, *args, *where, "--token-env", TOKEN_ENV],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, TOKEN_ENV: TOKEN, "COLUMNS": "200"},
    )


async def test_a_cli_prepare_during_a_collection_is_refused_naming_the_owner_until_it_takes_over(four):
    async with await discover([s.url for s in four], TOKEN) as collector:
        await collector.claim(COLLECTOR)  # a collection owns the deployment for its whole run
        refused = await cli(four, "prepare", "by-hand-1")
        assert refused.returncode == 1
        assert f"owned by another controller ({COLLECTOR}, until " in refused.stderr
        # Refused at its first stage (the environment): the later stages were never asked.
        assert "prepare was refused on 1 server(s) and changed nothing there" in refused.stderr
        assert "ng-checkpoint prepare by-hand-1 --take-over" in refused.stderr.replace("\n", " ")
        status, _ = await collector.status()
        assert {s["phase"] for s in status.values()} == {"idle"}  # nothing closed admission
        shown = await cli(four, "status")
        assert shown.stdout.count(f"owned by {COLLECTOR}") == 4, shown.stdout
        # The operator takes over: the collector is fenced for good.
        taken = await cli(four, "prepare", "by-hand-1", "--take-over", "--json")
        assert taken.returncode == 0, taken.stderr
        with pytest.raises(CoordinationError) as fenced:
            await collector.prepare("collect-000009-0a1b2c3d", timeout=10)
        assert set(fenced.value.codes.values()) == {"owner_fenced"}, fenced.value
        # The CLI's resume ends its checkpoint and gives the deployment back.
        resumed = await cli(four, "resume", "by-hand-1")
        assert resumed.returncode == 0, resumed.stderr
        status, _ = await collector.status()
        assert all("owner" not in s for s in status.values()), status
        document = orjson.loads((await cli(four, "status", "--json")).stdout)
        assert all("owner" not in p for p in document["participants"])


async def test_a_collector_refused_by_another_owner_gives_back_what_it_claimed(four):
    from nemo_gym_checkpoint_plugin.cli._collect_owner import take_deployment
    from nemo_gym_checkpoint_plugin.cli._where import UsageError

    async with await discover([s.url for s in four[:2]], TOKEN) as other:
        await other.claim(COLLECTOR)  # another controller owns two of the four servers
        async with await discover([s.url for s in four], TOKEN) as collector:
            said: list[str] = []
            with pytest.raises(UsageError, match=f"owned by another controller: {COLLECTOR} \\(2 of 4 servers\\)"):
                await take_deployment(
                    collector, "collect-99999999@here", take_over=False, predecessor=None, say=said.append, timeout=10
                )
            status, _ = await collector.status()
            # The two it could claim are given back: nothing is left owned by the refused collector.
            assert {s.get("owner") for s in status.values()} == {COLLECTOR, None}
            assert sum(1 for s in status.values() if s.get("owner") is None) == 2 and said == []
            # A dead predecessor is fenced without asking; so is anyone with --take-over.
            await take_deployment(
                collector, "collect-99999999@here", take_over=False, predecessor=COLLECTOR, say=said.append, timeout=10
            )
            status, _ = await collector.status()
            assert {s.get("owner") for s in status.values()} == {"collect-99999999@here"}
            assert said and "it is fenced for good" in said[0]
