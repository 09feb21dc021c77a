"""``example_single_tool_call`` whose ``/verify`` waits for the rollouts a test holds (tests only).

The random-sequence tests (``tests/deployment_machine.py``) hold one rollout's verify step so a prepare
in ``wait`` mode is not ready by its deadline, while every other rollout verifies at once. Under
``/health`` (never parked by the admission gate, so reachable while a checkpoint holds admission closed):

- ``POST /health/test/hold`` ``{"rollout_id": "r3"}``: every later and current ``/verify`` of that rollout
  (any attempt) waits;
- ``POST /health/test/release`` ``{"rollout_id": "r3"}`` (or ``{}``: every rollout) lets them through;
- ``GET /health/test/verify_calls``: the ``/verify`` calls entered per capture key.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from nemo_gym.base_resources_server import BaseVerifyRequest, BaseVerifyResponse
from nemo_gym.rollout_correlation import current_rollout_id
from pydantic import PrivateAttr
from resources_servers.example_single_tool_call.app import SimpleWeatherResourcesServer

from nemo_gym_checkpoint_plugin._identity import from_capture_key


class FuzzVerifyResourcesServer(SimpleWeatherResourcesServer):
    _verify_calls: dict[str, int] = PrivateAttr(default_factory=dict)
    _held: dict[str, asyncio.Event] = PrivateAttr(default_factory=dict)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.get("/health/test/verify_calls")(self.verify_calls)
        app.post("/health/test/hold")(self.hold)
        app.post("/health/test/release")(self.release)
        return app

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        key = current_rollout_id() or "unattributed"
        self._verify_calls[key] = self._verify_calls.get(key, 0) + 1
        held = self._held.get(from_capture_key(key).rollout_id) if key != "unattributed" else None
        if held is not None:
            await held.wait()
        return await super().verify(body)

    async def verify_calls(self) -> dict[str, int]:
        return dict(self._verify_calls)

    async def hold(self, request: Request) -> dict[str, bool]:
        rollout_id = str((await request.json())["rollout_id"])
        self._held.setdefault(rollout_id, asyncio.Event())
        return {"held": True}

    async def release(self, request: Request) -> dict[str, int]:
        body = await request.json()
        names = [str(body["rollout_id"])] if body.get("rollout_id") else list(self._held)
        for name in names:
            event = self._held.pop(name, None)
            if event is not None:
                event.set()
        return {"released": len(names)}


if __name__ == "__main__":
    FuzzVerifyResourcesServer.run_webserver()
