"""The ``preparing`` hook: a prepare hands its deadline to the participants, once, after admission closed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from control_support import Harness, close_harness, deadline, make_harness

from nemo_gym_checkpoint_plugin._errors import InvalidPhase
from nemo_gym_checkpoint_plugin._markers import hookimpl


class Preparing:
    """Records each ``preparing`` call and whether admission was closed by then; raises when told to."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.plane: Any = None

    @hookimpl
    def preparing(self, checkpoint_id: str, deadline_ts: float) -> None:
        self.calls.append(
            {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts, "admission_open": self.plane.admission.is_open}
        )
        if self.error is not None:
            raise self.error


@pytest.fixture
async def prep(tmp_path: Path) -> AsyncIterator[tuple[Harness, Preparing]]:
    plugin = Preparing()
    harness = await make_harness(tmp_path, extra_plugins=(plugin,))
    plugin.plane = harness.plane
    yield harness, plugin
    await close_harness(harness)


async def test_hook_preparing_gets_the_prepare_deadline_once_after_admission_closed(
    prep: tuple[Harness, Preparing],
) -> None:
    h, plugin = prep
    due = deadline()
    assert (await h.call("prepare", checkpoint_id="c1", deadline_ts=due))["phase"] == "prepared"
    await h.call("prepare", checkpoint_id="c1", deadline_ts=due + 1)  # a retry joins: no second call
    assert plugin.calls == [{"checkpoint_id": "c1", "deadline_ts": due, "admission_open": False}]
    assert "preparing" in h.recorder.names
    await h.call("commit", checkpoint_id="c1", checkpoint_dir=str(h.directory), episode_ids=None)
    await h.call("resume", checkpoint_id="c1")
    # A restore closes admission too, but is no prepare.
    await h.call("restore", checkpoint_id="r1", checkpoint_dir=str(h.directory), episode_ids=[])
    assert len(plugin.calls) == 1


async def test_hook_preparing_raising_aborts_the_prepare_and_reopens_admission(
    prep: tuple[Harness, Preparing],
) -> None:
    h, plugin = prep
    plugin.error = InvalidPhase("cannot prepare")
    await h.error("prepare", "invalid_phase", checkpoint_id="c1")
    assert h.plane.phase == "idle" and h.plane.admission.is_open and h.plane.checkpoint_id is None
    assert h.participant.called("open_admission") == [{"checkpoint_id": "c1"}]
