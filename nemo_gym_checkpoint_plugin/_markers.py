"""The pluggy markers of the ``nemo_gym_checkpoint`` project (the entry-point group's name too)."""

from __future__ import annotations

import pluggy

PROJECT = "nemo_gym_checkpoint"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = ["PROJECT", "hookimpl", "hookspec"]
