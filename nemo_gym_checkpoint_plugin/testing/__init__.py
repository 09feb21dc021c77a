"""The testing kit: a real Gym deployment on 127.0.0.1, a fake inference backend, the demo and ``serve``.

Shipped in the wheel so a third-party participant's tests, ``make demo`` and ``make serve``
run from an installed package, not only from a source checkout. No product module imports
it (the server runtime and the controller side never depend on test infrastructure).

- ``gym_config``: the Gym config of the demo deployment (built with Gym's own parser) and
  the ``/run`` bodies it takes;
- ``deployment``: ``Deployment``, the processes of that config (the fake backend and four
  Gym servers from the nemo-gym wheel), started, stopped and SIGKILLed by process group;
- ``fake_backend``: a deterministic OpenAI-compatible backend whose calls tests can hold
  and release (``python -m nemo_gym_checkpoint_plugin.testing.fake_backend --port N``);
- ``harness``: ``GymHarness`` (a started deployment plus the fake backend's controls),
  rollout senders and bounded waits;
- ``pytest_plugin``: the harness as pytest fixtures (``gym_deployment``,
  ``gym_deployment_factory``); load it with
  ``pytest_plugins = ["nemo_gym_checkpoint_plugin.testing.pytest_plugin"]`` in a conftest;
- ``crash_scenario``, ``collect_story`` (the demo's checkpointed collection, crashed and resumed),
  ``demo`` (``python -m nemo_gym_checkpoint_plugin.testing.demo``) and
  ``serve`` (``python -m nemo_gym_checkpoint_plugin.testing.serve``).

Submodules are imported on demand: importing this package loads nothing else.
"""
