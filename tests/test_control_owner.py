"""One controller per deployment: the owner lease a participant keeps, on its real control routes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from control_support import AUTH, Harness, close_harness, deadline, make_harness

from nemo_gym_checkpoint_plugin._wire import CONTROL_PREFIX

GRACE = 600.0


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await make_harness(tmp_path, grace_seconds=GRACE)
    harness.participant.add("r1")
    yield harness
    await close_harness(harness)


def _code(reply: dict) -> str:
    return reply["error"]["code"]


async def test_a_controller_that_sends_no_owner_sees_no_change_while_nobody_owns(h: Harness) -> None:
    await h.call("prepare", checkpoint_id="c1")
    await h.call("resume", checkpoint_id="c1")
    status = await h.client.get(f"{CONTROL_PREFIX}/status", headers=AUTH)
    assert "owner" not in status.json()  # the status of a participant nobody owns is unchanged


async def test_the_first_prepare_records_its_owner_and_every_other_controller_is_refused_naming_it(
    h: Harness,
) -> None:
    when = deadline()
    await h.call("prepare", checkpoint_id="c1", owner="collect-aaaa@host", deadline_ts=when)
    status = (await h.client.get(f"{CONTROL_PREFIX}/status", headers=AUTH)).json()
    assert status["owner"] == "collect-aaaa@host" and status["owner_expires_at"] == pytest.approx(when + GRACE)
    for owner in ("cli-root@host", None):
        body = {"checkpoint_id": "c1"} | ({"owner": owner} if owner else {})
        for route in ("prepare", "commit", "resume", "renew"):
            extra = {"checkpoint_dir": str(h.directory), "episode_ids": None} if route == "commit" else {}
            reply = await h.call(route, expect=409, **body, **extra)
            assert _code(reply) == "owner_conflict", (route, reply)
            assert "owned by collect-aaaa@host until" in reply["error"]["detail"]
    assert h.plane.phase == "prepared"  # nothing the refused calls asked for happened
    # Its owner goes on; ownership outlives the checkpoint (a collection owns it for its whole run).
    await h.call("resume", checkpoint_id="c1", owner="collect-aaaa@host")
    reply = await h.call("prepare", expect=409, checkpoint_id="c2", owner="cli-root@host")
    assert _code(reply) == "owner_conflict"
    # Released: the next controller may own it.
    released = await h.call("owner", owner="collect-aaaa@host", release=True)
    assert released["released"] is True and released["owner"] is None
    await h.call("prepare", checkpoint_id="c2", owner="cli-root@host")


async def test_take_over_fences_the_old_owner_for_good(h: Harness) -> None:
    await h.call("owner", owner="collect-aaaa@host")
    await h.call("prepare", checkpoint_id="c1", owner="collect-aaaa@host")
    taken = await h.call("owner", owner="collect-bbbb@host", take_over=True)
    assert taken["owner"] == "collect-bbbb@host"
    # The new owner ends what the old one left open; the old one is refused, whatever it sends.
    await h.call("resume", checkpoint_id="c1", owner="collect-bbbb@host")
    for route, body in (
        ("prepare", {"checkpoint_id": "c3"}),
        ("owner", {}),
        ("forget", {"checkpoint_id": "f", "rollout_ids": ["r1"]}),
    ):
        reply = await h.call(route, expect=409, owner="collect-aaaa@host", **body)
        assert _code(reply) == "owner_fenced" and "taken over by collect-bbbb@host" in reply["error"]["detail"]
    await h.call("owner", owner="collect-bbbb@host", release=True)
    reply = await h.call("prepare", expect=409, checkpoint_id="c4", owner="collect-aaaa@host")
    assert _code(reply) == "owner_fenced"  # for good: even once nobody owns the deployment


async def test_a_late_call_records_no_owner(h: Harness) -> None:
    reply = await h.call(
        "prepare", expect=409, checkpoint_id="c1", owner="collect-aaaa@host", deadline_ts=time.time() - 1
    )
    assert _code(reply) == "deadline_exceeded" and h.plane.owners.owner is None


async def test_an_expired_owner_lease_frees_the_participant(tmp_path: Path) -> None:
    now = [1_000_000.0]
    harness = await make_harness(tmp_path, grace_seconds=5.0, clock=lambda: now[0])
    try:
        await harness.call("owner", owner="collect-aaaa@host", deadline_ts=now[0] + 10)
        reply = await harness.call("owner", expect=409, owner="cli-root@host", deadline_ts=now[0] + 10)
        assert _code(reply) == "owner_conflict"
        now[0] += 16  # past deadline_ts + lease_grace_seconds
        reply = await harness.call("owner", owner="cli-root@host", deadline_ts=now[0] + 10)
        assert reply["owner"] == "cli-root@host"
    finally:
        await close_harness(harness)


async def test_owner_ids_are_checked_like_any_body_field(h: Harness) -> None:
    for bad in ("", "has space", "x" * 201, 7):
        response = await h.post("prepare", {"checkpoint_id": "c1", "deadline_ts": deadline(), "owner": bad})
        assert response.status_code == 422, bad
    response = await h.post("owner", {"owner": "a", "deadline_ts": deadline(), "extra": 1})
    assert response.status_code == 422
