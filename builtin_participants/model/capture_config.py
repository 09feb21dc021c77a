"""Which model servers write Gym's token-capture rows, and whether each is a checkpoint participant.

Gym's capture directory is run-wide: every model server a token-capturing agent calls writes
rows into it. A checkpoint carries only what participants export, so a model server outside the
checkpoint writes rows outside any checkpoint's cut: after a restore the trainer would read its
rows of the dead attempt beside the continued ones, or none. With checkpointing on, a model or
agent server therefore refuses to start when a token-capturing agent (Gym's own rule:
``token_id_capture.enabled`` and ``all_agents`` or the agent's ``token_id_capture: true``) names
a model server that is not a participant.

A server is a participant when its ``entrypoint`` is the plugin's wrapper
(``-mnemo_gym_checkpoint_plugin.wrap``, the bare module name, or a path to its ``wrap.py``), when its block says
``checkpoint_participant: true`` (a server class written with ``CheckpointMixin``: the config
cannot tell otherwise), or when it is the server starting (it is being built as one).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["PARTICIPANT_KEY", "uncheckpointed_capture"]

PARTICIPANT_KEY = "checkpoint_participant"
_AGENTS, _MODELS = "responses_api_agents", "responses_api_models"
_WRAP_MODULE = "nemo_gym_checkpoint_plugin.wrap"


def _servers(config: Mapping[str, Any], server_type: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``(name, inner config)`` of every top-level server of ``server_type`` in a Gym config."""
    for name, block in config.items():
        if not isinstance(block, Mapping) or not isinstance(block.get(server_type), Mapping):
            continue
        for inner in block[server_type].values():
            if isinstance(inner, Mapping):
                yield str(name), inner


def _model_refs(value: Any) -> Iterator[str]:
    """Names of the model servers a server config refers to (``{type: responses_api_models, name: X}``)."""
    if isinstance(value, Mapping):
        if value.get("type") == _MODELS and isinstance(value.get("name"), str):
            yield value["name"]
        for item in value.values():
            yield from _model_refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from _model_refs(item)


def _wrapped(entrypoint: Any) -> bool:
    """An ``entrypoint`` that runs the wrapper: its path, ``-m<module>`` (Gym's launcher) or the bare module."""
    text = str(entrypoint or "").strip()
    if text.endswith(".py"):
        return text.replace("\\", "/").endswith("nemo_gym_checkpoint_plugin/wrap.py")
    return text.removeprefix("-m").strip() == _WRAP_MODULE


def uncheckpointed_capture(config: Mapping[str, Any], starting: str | None) -> list[tuple[str, str]]:
    """``(agent, model server)`` pairs where a token-capturing agent names a model server that is no participant.

    ``starting`` is the server being built as a participant (never reported). Empty when token
    capture is off, or every such model server is a participant.
    """
    from nemo_gym.token_id_capture.config import token_id_capture_enabled_for_agent

    models = dict(_servers(config, _MODELS))
    found: list[tuple[str, str]] = []
    for agent, inner in _servers(config, _AGENTS):
        if not token_id_capture_enabled_for_agent(config, agent):
            continue
        for model in sorted(set(_model_refs(inner))):
            block = models.get(model)
            if model == starting or block is None:
                continue  # a name Gym's own config check refuses; not this check's to report
            if not (_wrapped(block.get("entrypoint")) or block.get(PARTICIPANT_KEY) is True):
                found.append((agent, model))
    return found
