"""``collector_paused``: no garbage collection while a hook builds thousands of objects at once.

A restore installs one session per episode: at 16,000 episodes the agent's install allocates
enough objects for CPython to run several full collections of the server's whole heap in the
middle of it (each one traverses every object the process holds), which tripled the install's
cost in ``benchmarks/participants.py --gc``. The control plane's own pause
(``_collector.py``: nesting-aware, it gives back the collector's previous state) is the
one used here, so an install called inside a restore's pause and one called on its own agree.
"""

from __future__ import annotations

from nemo_gym_checkpoint_plugin._collector import collector_paused

__all__ = ["collector_paused"]
