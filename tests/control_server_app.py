"""An app factory for the real-process test: one control plane with the in-test participant.

Run as ``python -m uvicorn control_server_app:make_app --factory`` from ``tests/``; the token
comes from ``NG_CHECKPOINT_TEST_TOKEN``, like a real deployment's ``control_auth_token_env``.
"""

from __future__ import annotations

import os

from control_support import INSTANCE, KIND, Participant
from fastapi import FastAPI

from nemo_gym_checkpoint_plugin._control import ControlPlane
from nemo_gym_checkpoint_plugin._plugins import make_plugin_manager
from nemo_gym_checkpoint_plugin._routes import attach
from nemo_gym_checkpoint_plugin._settings import CheckpointSettings


def make_app() -> FastAPI:
    participant = Participant()
    participant.add("r1", "r2-a1")
    pm = make_plugin_manager([participant], load_entry_points=False)
    plane = ControlPlane(pm, kind=KIND, instance=INSTANCE, settings=CheckpointSettings(enabled=True))
    app = FastAPI()
    attach(app, plane, os.environ["NG_CHECKPOINT_TEST_TOKEN"])
    app.router.on_shutdown.append(plane.aclose)
    return app
