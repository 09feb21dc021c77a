"""Shared test settings. Process-level tests never start Ray and only use 127.0.0.1."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
