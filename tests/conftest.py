"""Shared test settings. Process-level tests never start Ray and only use 127.0.0.1."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# The testing kit's fixtures (gym_deployment, gym_deployment_factory), as a participant's own tests load them.
pytest_plugins = ["nemo_gym_checkpoint_plugin.testing.pytest_plugin"]
