"""Shared test settings. Process-level tests never start Ray and only use 127.0.0.1."""

from __future__ import annotations

import os

from hypothesis import settings

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# Property tests draw the same examples on every run by default ("ci": derandomized, no example database),
# so a red run is reproducible and CI never goes red on a seed nobody saw. HYPOTHESIS_PROFILE=explore draws
# new ones each run, for looking for failures on purpose.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The testing kit's fixtures (gym_deployment, gym_deployment_factory), as a participant's own tests load them.
pytest_plugins = ["nemo_gym_checkpoint_plugin.testing.pytest_plugin"]
