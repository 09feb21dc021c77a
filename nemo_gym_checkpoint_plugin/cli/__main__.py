"""``python -m nemo_gym_checkpoint_plugin.cli``: the same as ``ng-checkpoint``."""

from __future__ import annotations

import sys

from . import main

sys.exit(main())
