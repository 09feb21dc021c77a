"""A commit into a directory holding another checkpoint is refused before any participant writes (issue 24).

The issue's case: another deployment's checkpoint in the directory shares one participant's
``kind/instance`` with this deployment. That participant alone refused; the three others wrote
beside it and the good checkpoint then failed ``verify`` for every participant. Now the
coordination library (and so the CLI's ``commit`` and ``collect``) refuses first, on real
participant processes: nothing in the directory changes and the good checkpoint still verifies.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from coord_support import TOKEN, config_for, four_participants, stop_participants
from test_cli_live import TOKEN_ENV, cli, urls

from nemo_gym_checkpoint_plugin._storage.index import write_participants_index
from nemo_gym_checkpoint_plugin._storage.writer import CheckpointWriter
from nemo_gym_checkpoint_plugin.coordination import CoordinationError, discover

pytestmark = pytest.mark.slow

# The other deployment: its environment is named as ours ("env"), its other participants are not.
OTHER = [("environment", "env"), ("model", "their_model"), ("agent", "their_agent")]


@pytest.fixture
def four(tmp_path):
    servers = four_participants(tmp_path)
    yield servers
    stop_participants(servers)


def _other_deployments_checkpoint(directory: Path) -> None:
    manifests = [
        CheckpointWriter(directory, kind, instance, "theirs-1").write(
            [{"episode_id": {"rollout_id": f"t{i}", "attempt": 0}, "owner": instance} for i in range(2)]
        )
        for kind, instance in OTHER
    ]
    write_participants_index(
        directory, "theirs-1", [{name: m[name] for name in ("kind", "instance", "records_sha256")} for m in manifests]
    )


def _tree(directory: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(directory)): (p.read_bytes() if p.is_file() else None) for p in sorted(directory.rglob("*"))
    }


def test_a_commit_into_another_checkpoints_directory_is_refused_with_nothing_written(four, tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    _other_deployments_checkpoint(shared)
    assert cli("verify", str(shared)).returncode == 0
    before = _tree(shared)
    monkeypatch.setenv("COORD_TEST_TOKEN", TOKEN)

    async def library() -> CoordinationError:
        async with await discover(config_for(four), TOKEN) as coordinator:
            prepared = await coordinator.prepare("step-1", timeout=20)
            assert prepared.ready, prepared.to_json()
            with pytest.raises(CoordinationError) as caught:
                await coordinator.commit("step-1", str(shared), None, timeout=20)
            # The participants were never called: the same prepared checkpoint commits into a new directory.
            await coordinator.commit("step-1", str(tmp_path / "fresh"), None, timeout=20)
            await coordinator.resume("step-1", timeout=20)
            return caught.value

    refusal = asyncio.run(library())
    assert refusal.codes == {"(checkpoint)": "invalid_checkpoint_state"}, refusal
    assert sorted(refusal.result["other_checkpoints"]) == sorted(
        [f"{shared}/gym/participants.json lists checkpoint 'theirs-1'"]
        + [f"{shared}/gym/{kind}/{instance}/manifest.json is of checkpoint 'theirs-1'" for kind, instance in OTHER]
    )
    assert "nothing was written" in str(refusal)
    assert _tree(shared) == before
    assert cli("verify", str(tmp_path / "fresh")).returncode == 0

    # The CLI's commit: the same refusal, said as such (not "incomplete: do not restore from it").
    where = [*urls(four), "--token-env", TOKEN_ENV]
    assert cli("prepare", "step-2", *where, "--deadline", "20").returncode == 0
    committed = cli("commit", "step-2", *where, "--dir", str(shared), "--all")
    assert committed.returncode == 1, committed.stdout + committed.stderr
    assert "holds another checkpoint" in committed.stderr and "nothing was written" in committed.stderr
    assert "do not restore from it" not in committed.stderr
    assert f"--dir {shared}-retry" in committed.stderr  # the command to commit elsewhere
    assert cli("resume", "step-2", *where).returncode == 0
    assert _tree(shared) == before
    verified = cli("verify", str(shared))
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_a_retried_commit_of_the_same_id_is_not_refused(four, tmp_path):
    ckpt = tmp_path / "ckpt"

    async def twice() -> None:
        async with await discover(config_for(four), TOKEN) as coordinator:
            await coordinator.prepare("step-1", timeout=20)
            first = await coordinator.commit("step-1", str(ckpt), None, timeout=20)
            again = await coordinator.commit("step-1", str(ckpt), None, timeout=20)
            assert again.manifests == first.manifests
            await coordinator.resume("step-1", timeout=20)

    asyncio.run(twice())
