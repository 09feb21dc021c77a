"""The lease: extended by every call, self-resume on expiry, retried after a failure."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from control_support import Gate, Harness, close_harness, make_harness, wait_until, wire

from nemo_gym_checkpoint_plugin._control import ControlPlane, LeasePolicy
from nemo_gym_checkpoint_plugin._markers import hookimpl
from nemo_gym_checkpoint_plugin._plugins import make_plugin_manager
from nemo_gym_checkpoint_plugin._settings import CheckpointSettings


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await make_harness(tmp_path, grace_seconds=0.3, retry_seconds=0.2)
    yield harness
    await close_harness(harness)


async def test_every_call_extends_the_lease_to_deadline_plus_grace(h: Harness) -> None:
    assert (await h.status())["lease_expires_at"] is None
    first = time.time() + 30
    await h.call("prepare", checkpoint_id="c1", deadline_ts=first)
    assert (await h.status())["lease_expires_at"] == pytest.approx(first + 0.3)
    later = time.time() + 60
    assert (await h.call("renew", checkpoint_id="c1", deadline_ts=later))["lease_expires_at"] == pytest.approx(
        later + 0.3
    )
    # An earlier deadline never shortens the lease.
    await h.call("renew", checkpoint_id="c1", deadline_ts=time.time() + 5)
    assert (await h.status())["lease_expires_at"] == pytest.approx(later + 0.3)
    await h.call(
        "commit", checkpoint_id="c1", checkpoint_dir=str(h.directory), episode_ids=None, deadline_ts=later + 10
    )
    assert (await h.status())["lease_expires_at"] == pytest.approx(later + 10.3)
    await h.call("resume", checkpoint_id="c1")
    assert (await h.status())["lease_expires_at"] is None


async def test_renew_needs_an_active_checkpoint(h: Harness) -> None:
    await h.error("renew", "invalid_phase", checkpoint_id="c1")


async def test_an_expired_lease_resumes_on_its_own(h: Harness) -> None:
    await h.call("prepare", checkpoint_id="c1", deadline_ts=time.time() + 0.2)
    assert not h.plane.admission.is_open
    await wait_until(lambda: h.plane.phase == "idle", timeout=10, what="the self-resume")
    assert h.plane.admission.is_open and h.plane.lease.self_resumes == 1
    assert h.participant.called("open_admission") == [{"checkpoint_id": "c1"}]
    await h.error("prepare", "stale_checkpoint", checkpoint_id="c1")


async def test_an_expired_lease_after_a_restore_resumes_too(h: Harness) -> None:
    h.participant.add("r1")
    await h.checkpoint("c1", ["r1"])
    await h.call("resume", checkpoint_id="c1")
    await h.call(
        "restore",
        checkpoint_id="r-1",
        checkpoint_dir=str(h.directory),
        episode_ids=[wire("r1")],
        deadline_ts=time.time() + 0.6,
    )
    await wait_until(lambda: h.plane.phase == "idle", timeout=10, what="the self-resume")
    assert h.plane.admission.is_open


async def test_a_failed_self_resume_is_retried_at_the_policy_interval(h: Harness) -> None:
    h.participant.add("r1-a1", "r2-a1")
    h.participant.pending = {"r1-a1", "r2-a1"}
    h.participant.delete_gate = gate = Gate()
    await h.call("prepare", checkpoint_id="c1", deadline_ts=time.time() + 1.0)
    await h.call(
        "commit",
        checkpoint_id="c1",
        checkpoint_dir=str(h.directory),
        episode_ids=[wire("r1-a1")],
        deadline_ts=time.time() + 0.3,
    )
    # The cleanup is held, so each self-resume runs out of its time (one retry interval) and is retried.
    await wait_until(lambda: h.plane.lease.failed_self_resumes >= 2, timeout=10, what="two failed self-resumes")
    assert h.plane.phase == "committed" and not h.plane.admission.is_open
    gate.release()
    await wait_until(lambda: h.plane.phase == "idle", timeout=10, what="a successful self-resume")
    assert h.plane.admission.is_open


class ShortLease:
    @hookimpl
    def lease_policy(self, settings: CheckpointSettings) -> LeasePolicy:
        return LeasePolicy(grace_seconds=settings.lease_grace_seconds / 2, retry_seconds=1.5)


async def test_hook_lease_policy_default_and_replacement() -> None:
    settings = CheckpointSettings(enabled=True, lease_grace_seconds=40)
    default = make_plugin_manager(load_entry_points=False).hook.lease_policy(settings=settings)
    assert default == LeasePolicy(grace_seconds=40, retry_seconds=30)
    pm = make_plugin_manager([ShortLease()], load_entry_points=False)
    plane = ControlPlane(pm, kind="model", instance="m", settings=settings)
    assert plane.lease.policy == LeasePolicy(grace_seconds=20, retry_seconds=1.5)
    assert plane.lease.policy.expires_at(100.0) == 120.0
    await plane.aclose()


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan")])
def test_lease_policy_refuses_bad_durations(bad: float) -> None:
    with pytest.raises(ValueError, match="grace_seconds"):
        LeasePolicy(grace_seconds=bad)
