"""``example_single_tool_call`` whose ``/verify`` waits until the test releases it (tests only).

So a rollout can sit in its verify step while a checkpoint is taken. The verdict is the
wheel's. ``GET /health/test/verify_calls`` counts the ``/verify`` calls entered per rollout
(capture key); ``POST /health/test/release`` lets every held and later verify through. Both
live under ``/health``, which the admission gate never parks, so the test reaches them while
a checkpoint holds admission closed.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from nemo_gym.base_resources_server import BaseVerifyRequest, BaseVerifyResponse
from nemo_gym.rollout_correlation import current_rollout_id
from pydantic import PrivateAttr
from resources_servers.example_single_tool_call.app import SimpleWeatherResourcesServer


class HeldVerifyResourcesServer(SimpleWeatherResourcesServer):
    _verify_calls: dict[str, int] = PrivateAttr(default_factory=dict)
    _released: asyncio.Event = PrivateAttr(default_factory=asyncio.Event)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.get("/health/test/verify_calls")(self.verify_calls)
        app.post("/health/test/release")(self.release)
        return app

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        key = current_rollout_id() or "unattributed"
        self._verify_calls[key] = self._verify_calls.get(key, 0) + 1
        await self._released.wait()
        return await super().verify(body)

    async def verify_calls(self) -> dict[str, int]:
        return dict(self._verify_calls)

    async def release(self) -> dict[str, bool]:
        self._released.set()
        return {"released": True}


if __name__ == "__main__":
    HeldVerifyResourcesServer.run_webserver()
