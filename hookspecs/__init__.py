"""Hook specifications of nemo-gym-checkpoint (installed as ``nemo_gym_checkpoint_plugin.hookspecs``).

Import it by its installed name; the bare ``hookspecs`` would load a second copy.
"""

from __future__ import annotations

from nemo_gym_checkpoint_plugin.hookspecs import core, participant

from nemo_gym_checkpoint_plugin._markers import hookimpl, hookspec

__all__ = ["core", "participant", "hookimpl", "hookspec", "SPEC_MODULES"]

# Every module of specs the plugin manager adds, in one place.
SPEC_MODULES = (core, participant)
