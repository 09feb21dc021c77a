"""The testing kit's pytest plugin: ``participant_servers`` builds a server in process as a participant."""

pytest_plugins = ["nemo_gym_checkpoint_plugin.testing.pytest_plugin"]
