"""Failure handling of the coordination library against real participant servers."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from coord_support import FOUR, TOKEN, config_for, start_participants, stop_participants

from nemo_gym_checkpoint_plugin.coordination import (
    CoordinationError,
    commit,
    discover,
    prepare,
    restore,
    resume,
)

pytestmark = pytest.mark.slow

PROBE_TIMEOUT, TRIES, RETRY_DELAY = 0.5, 2, 0.1
BOUND = TRIES * PROBE_TIMEOUT + (TRIES - 1) * RETRY_DELAY


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_down_hung_unknown_and_non_participant_servers_are_reported_within_the_bound(tmp_path):
    specs = [
        {"kind": "model", "instance": "policy_model"},
        {"kind": "agent", "instance": "hung_agent", "hang": ["status"]},
        {"kind": "resources", "instance": "odd", "status_kind": "verifier"},
        {"kind": "resources", "instance": "plain_gym", "disabled": True},
    ]
    servers = start_participants(tmp_path, specs)
    model, hung, odd, plain = servers
    down_url = f"http://127.0.0.1:{closed_port()}"
    # A socket that completes the TCP handshake (the kernel's backlog) but whose owner never reads.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    urls = [s.url for s in servers] + [down_url, silent_url]
    try:
        started = time.monotonic()
        with pytest.raises(CoordinationError) as caught:
            await discover(urls, TOKEN, probe_timeout=PROBE_TIMEOUT, tries=TRIES, retry_delay=RETRY_DELAY)
        elapsed = time.monotonic() - started
        # Every probe runs at once, so the whole discovery is bounded by one server's tries.
        assert elapsed < BOUND + 1.0, f"discovery took {elapsed:.2f}s, bound {BOUND:.2f}s"
        assert caught.value.codes == {
            hung.url: "timeout",
            odd.url: "unknown_kind",
            down_url: "unreachable",
            silent_url: "timeout",
        }
        # The hung participant was asked TRIES times, then given up on.
        assert hung.ops().count("status") == TRIES

        # Not strict: the same findings ride on the coordinator, with the 404 server set apart.
        async with await discover(
            urls, TOKEN, probe_timeout=PROBE_TIMEOUT, tries=TRIES, retry_delay=RETRY_DELAY, strict=False
        ) as coordinator:
            assert [(p.name, p.url) for p in coordinator.participants] == [(model.name, model.url)]
            assert [e.url for e in coordinator.non_participants] == [plain.url]
            assert {f.server for f in coordinator.failures} == {hung.url, odd.url, down_url, silent_url}
    finally:
        silent.close()
        stop_participants(servers)


async def test_no_model_participant_is_an_error(tmp_path):
    servers = start_participants(tmp_path, [dict(FOUR[0]), dict(FOUR[2])])
    try:
        with pytest.raises(CoordinationError) as caught:
            await discover([s.url for s in servers], TOKEN, probe_timeout=PROBE_TIMEOUT, tries=TRIES)
        assert [f.code for f in caught.value.failures] == ["no_model_participant"]
    finally:
        stop_participants(servers)


async def test_wrong_token_and_config_token(tmp_path, monkeypatch):
    servers = start_participants(tmp_path, [dict(FOUR[1])])
    try:
        with pytest.raises(CoordinationError) as caught:
            await discover([servers[0].url], "not-the-token", probe_timeout=PROBE_TIMEOUT, tries=TRIES)
        assert caught.value.codes[servers[0].url] == "unauthorized"
        assert "not-the-token" not in str(caught.value)
        # From a Gym config: the token comes from the variable its checkpoint block names.
        monkeypatch.setenv("COORD_TEST_TOKEN", TOKEN)
        async with await discover(config_for(servers)) as coordinator:
            assert [p.name for p in coordinator.participants] == ["policy_model"]
    finally:
        stop_participants(servers)


def test_a_config_block_without_an_address_is_reported():
    config = {"policy_model": {"responses_api_models": {"vllm_model": {"entrypoint": "app.py"}}}}

    async def run() -> None:
        await discover(config, TOKEN, probe_timeout=PROBE_TIMEOUT, tries=TRIES)

    with pytest.raises(CoordinationError) as caught:
        asyncio.run(run())
    assert caught.value.codes["policy_model"] == "unresolved_address"


async def test_servers_come_from_the_head_server_or_a_server_client(tmp_path, monkeypatch):
    """A config without ports (Gym picks them at start) is resolved through its head server."""
    model = start_participants(tmp_path, [dict(FOUR[1])])[0]
    resolved = config_for([model])
    host, port = model.url.removeprefix("http://").split(":")
    head_spec = dict(
        FOUR[0],
        instance="head",
        name="head",
        disabled=True,
        serves_config={**resolved, "head_server": {"host": host, "port": int(port)}},
    )
    head = start_participants(tmp_path, [head_spec])[0]
    head_host, head_port = head.url.removeprefix("http://").split(":")
    unresolved = {
        "head_server": {"host": head_host, "port": int(head_port)},
        "checkpoint": resolved["checkpoint"],
        "policy_model": {"responses_api_models": {"vllm_model": {"entrypoint": "app.py"}}},
    }
    monkeypatch.setenv("COORD_TEST_TOKEN", TOKEN)
    try:
        async with await discover(unresolved, probe_timeout=PROBE_TIMEOUT, tries=TRIES) as coordinator:
            assert [(p.name, p.url, p.kind) for p in coordinator.participants] == [("policy_model", model.url, "model")]
        # Gym's own ServerClient, as a controller inside Gym holds it.
        from nemo_gym.config_types import BaseServerConfig
        from nemo_gym.server_utils import ServerClient
        from omegaconf import OmegaConf

        client = ServerClient(
            head_server_config=BaseServerConfig(host=head_host, port=int(head_port)),
            global_config_dict=OmegaConf.create(resolved),
        )
        async with await discover(client, probe_timeout=PROBE_TIMEOUT, tries=TRIES) as coordinator:
            assert [p.name for p in coordinator.participants] == ["policy_model"]
    finally:
        stop_participants([model, head])


async def committed_checkpoint(tmp_path, coordinator, checkpoint_dir) -> None:
    assert (await prepare(coordinator, "step-1", timeout=10)).ready
    await commit(coordinator, "step-1", str(checkpoint_dir), ["r1", "r2-a1"], timeout=10)
    await resume(coordinator, "step-1", timeout=10)


async def test_a_failed_restore_retires_the_replacements_and_resumes_everyone(tmp_path):
    specs = [dict(spec, holds=["r1", "r2-a1"]) for spec in FOUR]
    specs[3]["fail"] = {"retire": "invalid_phase"}  # the resources server will refuse the clean-up retire
    servers = start_participants(tmp_path, specs)
    env, model, agent, tools = servers
    ckpt = tmp_path / "ckpt"
    try:
        async with await discover([s.url for s in servers], TOKEN) as coordinator:
            await committed_checkpoint(tmp_path, coordinator, ckpt)
            # The agent's part of the checkpoint is lost: its restore fails for real. (The participants
            # index goes too, or the coordinator would refuse before asking anyone: see test_storage_index.)
            (ckpt / "gym" / "agent" / "agent" / "manifest.json").unlink()
            (ckpt / "gym" / "participants.json").unlink()
            with pytest.raises(CoordinationError) as caught:
                await restore(coordinator, "restore-1", str(ckpt), ["r1", "r2-a1"], timeout=10)
            error = caught.value
            # The restore's error, not the clean-up's: the agent and its code.
            assert error.operation == "restore"
            assert [(f.server, f.code) for f in error.failures] == [(agent.name, "invalid_checkpoint_state")]
            assert [(f.server, f.operation, f.code) for f in error.cleanup_failures] == [
                (tools.name, "retire", "invalid_phase")
            ]
            # Every replacement was installed by some participant that replied: all of them are retired.
            assert error.result == {
                "next_attempts": {"r1": 2, "r2": 3},
                "retired": ["r1-a1", "r2-a2"],
                "left_alone": [],
            }
            for server in servers:
                events = server.events()
                retired = [e["keys"] for e in events if e["op"] == "retired"]
                # Where the read succeeded (all at once), restore first retired the checkpointed attempts
                # before installing; then the clean-up retired the replacements everywhere.
                if server in (env, model):
                    assert retired == [["r1", "r2-a1"], ["r1-a1", "r2-a2"]], server.name
                elif server is agent:
                    assert retired == [["r1-a1", "r2-a2"]], server.name
                # Every participant was resumed after the failed restore (the second resume it saw).
                assert server.ops().count("resume") == 2, server.name
                assert server.first("restore") < [e["t"] for e in events if e["op"] == "resume"][-1]
            statuses, failures = await coordinator.status()
            assert not failures and {s["phase"] for s in statuses.values()} == {"idle"}
    finally:
        stop_participants(servers)


async def test_a_restore_every_participant_refused_retires_nothing_and_resumes_everyone(tmp_path):
    specs = [dict(spec, holds=["r1", "r2-a1"], fail={"restore": "invalid_phase"}) for spec in FOUR]
    servers = start_participants(tmp_path, [dict(spec, holds=["r1", "r2-a1"]) for spec in FOUR])
    ckpt = tmp_path / "ckpt"
    try:
        async with await discover([s.url for s in servers], TOKEN) as coordinator:
            await committed_checkpoint(tmp_path, coordinator, ckpt)
    finally:
        stop_participants(servers)
    # The same checkpoint, restored by participants that all refuse (none installed anything).
    (tmp_path / "again").mkdir()
    servers = start_participants(tmp_path / "again", specs)
    try:
        async with await discover([s.url for s in servers], TOKEN) as coordinator:
            with pytest.raises(CoordinationError) as caught:
                await restore(coordinator, "restore-1", str(ckpt), ["r1", "r2-a1"], timeout=10)
            assert caught.value.result == {"next_attempts": {"r1": 2, "r2": 3}, "retired": [], "left_alone": []}
            for server in servers:
                # Nothing to retire: a refused restore never retires what it did not install.
                assert "retire" not in server.ops(), server.name
                assert "resume" in server.ops(), server.name
    finally:
        stop_participants(servers)


async def test_a_replacement_refused_as_running_elsewhere_is_left_alone(tmp_path):
    specs = [dict(spec, holds=["r1", "r2-a1"]) for spec in FOUR]
    servers = start_participants(tmp_path, specs)
    ckpt = tmp_path / "ckpt"
    try:
        async with await discover([s.url for s in servers], TOKEN) as coordinator:
            await committed_checkpoint(tmp_path, coordinator, ckpt)
    finally:
        stop_participants(servers)
    # r1's replacement runs on the environment (another controller's): refused attempt_running there.
    specs[0]["fail"] = {"restore": ["attempt_running", ["r1-a1"]]}
    (tmp_path / "again").mkdir()
    servers = start_participants(tmp_path / "again", specs)
    try:
        async with await discover([s.url for s in servers], TOKEN) as coordinator:
            with pytest.raises(CoordinationError) as caught:
                await restore(coordinator, "restore-1", str(ckpt), ["r1", "r2-a1"], timeout=10)
            assert [(f.code, f.episodes) for f in caught.value.failures] == [("attempt_running", ("r1-a1",))]
            assert caught.value.result["retired"] == ["r2-a2"] and caught.value.result["left_alone"] == ["r1-a1"]
            for server in servers:
                clean_up = [e["keys"] for e in server.events() if e["op"] == "retired"][-1:]
                if server is not servers[0]:  # the others installed both; only r2's replacement is retired
                    assert clean_up == [["r2-a2"]], server.name
    finally:
        stop_participants(servers)


async def test_resume_keeps_going_past_failing_participants_and_reports_them_all(tmp_path):
    specs = [dict(spec) for spec in FOUR]
    specs[2]["hang"] = ["resume"]  # the agent never replies
    specs[3]["fail"] = {"resume": "checkpoint_conflict"}  # the resources server refuses
    servers = start_participants(tmp_path, specs)
    env, model, agent, tools = servers
    try:
        async with await discover([s.url for s in servers], TOKEN, reply_grace=0.5) as coordinator:
            assert (await prepare(coordinator, "step-1", timeout=10)).ready
            model.process.kill()  # and the model server dies
            model.process.wait(timeout=10)
            with pytest.raises(CoordinationError) as caught:
                await resume(coordinator, "step-1", timeout=1.0)
            assert caught.value.codes == {
                tools.name: "checkpoint_conflict",
                agent.name: "timeout",
                model.name: "unreachable",
            }
            # Past three failures (resources, agent, model), the environment, last in the order, still resumed.
            assert set(caught.value.result) == {env.name}
            assert "resume" in env.ops()
            statuses, _ = await coordinator.status()
            assert statuses[env.name]["phase"] == "idle"
    finally:
        stop_participants(servers)
