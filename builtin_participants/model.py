"""The policy model participant (kind ``model``): model calls in flight, held responses, retire.

docs/protocol.md, "Mid-turn boundaries": a checkpoint never waits for a generation.

- ``close_admission``: new model calls park at the admission gate (attributed by their
  ``/ng-rollout/<capture key>/...`` prefix, which the plugin's client always adds). A call
  already past the gate keeps running at the inference worker; its response is **held** if it
  has not started reaching its caller (``held_responses.py`` says what starts a response).
- ``ready`` never reports a blocker: a generation never delays a checkpoint. Its counts say
  how many calls run and how many responses are held.
- A held call belongs to no checkpoint: nothing is exported for it (the agent's boundary is
  before it). ``open_admission`` (resume) delivers every held response unchanged.
- ``retire`` cancels the running calls of the named attempts and earlier ones (the route's
  call to the inference worker is cancelled, so the worker sees its request dropped), waits
  for them to end, then returns; a call stopped before its answer started is answered
  ``stale_attempt``. A retried retire waits for calls an earlier one stopped without
  cancelling them again. Later calls of a retired attempt are refused by the gate.

One registry per model server process; used from its event loop only.
"""

from __future__ import annotations

import asyncio
from typing import Any

from nemo_gym_checkpoint_plugin.identity import EpisodeId
from nemo_gym_checkpoint_plugin.markers import hookimpl
from nemo_gym_checkpoint_plugin.types import Readiness

__all__ = ["ModelCall", "ModelCalls", "install_model_calls"]


class ModelCall:
    """One data request to the model server, from the gate to its last response message."""

    __slots__ = ("rollout_id", "attempt", "task", "held", "retired", "finished")

    def __init__(self, rollout_id: str | None, attempt: int) -> None:
        self.rollout_id = rollout_id  # None: a call outside any rollout (never retired)
        self.attempt = attempt
        self.task: asyncio.Future[Any] | None = None
        self.held = False
        self.retired = False
        self.finished = asyncio.Event()


class ModelCalls:
    """Participant plugin of a Gym model server (see the module docstring)."""

    def __init__(self, server: Any = None) -> None:
        self.server = server
        self._open = asyncio.Event()
        self._open.set()
        self._by_rollout: dict[str | None, set[ModelCall]] = {}
        self.in_flight = 0
        self.held = 0
        self.served_total = 0
        self.held_total = 0
        self.stopped_total = 0

    # -- the middleware's side ---------------------------------------------------------------------

    def begin(self, attempt: tuple[str, int] | None) -> ModelCall:
        rollout_id, number = attempt if attempt is not None else (None, 0)
        call = ModelCall(rollout_id, number)
        self._by_rollout.setdefault(rollout_id, set()).add(call)
        self.in_flight += 1
        return call

    def end(self, call: ModelCall) -> None:
        siblings = self._by_rollout.get(call.rollout_id)
        if siblings is not None:
            siblings.discard(call)
            if not siblings:
                del self._by_rollout[call.rollout_id]
        self.in_flight -= 1
        self.served_total += 1
        call.finished.set()

    async def hold(self, call: ModelCall) -> None:
        """Return once admission is open (at once when it is): the call's response may start."""
        if self._open.is_set():
            return
        call.held = True
        self.held += 1
        self.held_total += 1
        try:
            # A wake that finds a new checkpoint already closed admission holds on for that one too.
            while not self._open.is_set():
                await self._open.wait()
        finally:
            call.held = False
            self.held -= 1

    # -- participant hooks -------------------------------------------------------------------------

    @hookimpl
    def close_admission(self, checkpoint_id: str) -> None:
        self._open.clear()

    @hookimpl
    def open_admission(self, checkpoint_id: str) -> None:
        self._open.set()

    @hookimpl
    def ready(self, checkpoint_id: str | None) -> Readiness:
        # Never a blocker: a generation in flight runs on, and its response is held if not started.
        return Readiness(counts={"model_calls_in_flight": self.in_flight, "model_responses_held": self.held})

    @hookimpl
    async def retire(self, episode_ids: list[EpisodeId]) -> None:
        victims: list[ModelCall] = []
        for episode in episode_ids:
            for call in self._by_rollout.get(episode.rollout_id, ()):
                if call.attempt <= episode.attempt:
                    victims.append(call)
        for call in victims:
            if not call.retired:  # a retried retire waits for what an earlier one stopped
                call.retired = True
                self.stopped_total += 1
                if call.task is not None:
                    call.task.cancel()
        await asyncio.gather(*(call.finished.wait() for call in victims))

    @hookimpl
    def status_fields(self) -> dict[str, Any]:
        return {
            "model_calls": {
                "in_flight": self.in_flight,
                "held": self.held,
                "served_total": self.served_total,
                "held_total": self.held_total,
                "stopped_total": self.stopped_total,
            }
        }


def install_model_calls(app: Any, calls: ModelCalls) -> None:
    """Install the held-responses middleware of ``calls`` on a model server's ``app``."""
    from nemo_gym_checkpoint_plugin.builtin_participants.held_responses import install_held_responses

    install_held_responses(app, calls)
