"""A verifier written with ``CheckpointMixin`` that keeps its own per-session state (tests' Gym server).

It overrides ``seed_session`` and declares no ``checkpoint_mode``, so the built-in resources
participant makes every episode it seeds a restart, and says so at startup and in its status.
Started as Gym starts a server: ``python <this file>`` from a resources server directory,
with ``NEMO_GYM_CONFIG_DICT`` / ``NEMO_GYM_CONFIG_PATH`` in the environment.
"""

from __future__ import annotations

from typing import Any

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from pydantic import PrivateAttr

from nemo_gym_checkpoint_plugin.mixin import CheckpointMixin


class SessionVerifier(CheckpointMixin, SimpleResourcesServer):
    config: BaseResourcesServerConfig
    _seeded: dict[str, Any] = PrivateAttr(default_factory=dict)

    async def seed_session(self, body: Any) -> Any:
        # Per-session state of its own, which no participant plugin exports.
        self._seeded[str(getattr(body, "resources_session_id", len(self._seeded)))] = body
        return await super().seed_session(body)

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        return BaseVerifyResponse(**body.model_dump(), reward=1.0)


if __name__ == "__main__":
    SessionVerifier.run_webserver()
