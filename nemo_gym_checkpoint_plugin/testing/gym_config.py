"""The Gym config of the demo deployment and the episode bodies it takes, built with Gym's own parser.

Names and ports (``port_base`` + offset), all on 127.0.0.1:

- ``fake_backend`` (+0): the OpenAI-compatible fake backend (not a Gym server);
- ``policy_model`` (+1): ``responses_api_models/vllm_model`` pointed at the backend;
- ``simple_agent`` (+2): ``responses_api_agents/simple_agent``;
- ``example_single_tool_call`` (+3): the resources server of that name;
- ``single_agent_turn`` (+4): ``environment_servers/single_agent_turn``;
- the head server's port (+5) is reserved in the config; nothing needs it started.

With ``replicas=K`` (default 1: exactly the servers above) the model, agent and
environment servers run K times: replica ``i >= 2`` is ``policy_model_<i>``,
``simple_agent_<i>`` and ``single_agent_turn_<i>`` on ports ``+6 + 3 (i - 2)`` and the
two after it, chained ``single_agent_turn_<i> -> simple_agent_<i> -> policy_model_<i>``
(Gym resolves a server reference by its top-level name). Their blocks are Gym's own
``_copy`` of the first replica's with the port and references overridden, so the written
YAML holds one plain block per server, as a hand-written multi-server Gym config does.
The resources server and the fake backend stay one each.

``build_gym_config`` runs Gym's ``GlobalConfigDictParser`` (CLI and dotenv skipped,
``offline`` so it neither probes ports nor touches this process's environment or
exporters) over the servers' shipped YAML plus overrides that bind names, ports and
the backend. ``single_agent_turn`` defaults to the ``nemo_gym_checkpoint_plugin._ray_off``
entrypoint because its class leaves ``ray_enabled`` unset, which starts Ray;
``wrapped_entrypoints()`` runs every server through ``nemo_gym_checkpoint_plugin.wrap``
instead (Ray off too, and a checkpoint participant when the block is enabled).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "AGENT",
    "BACKEND",
    "DEFAULT_CHECKPOINT_BLOCK",
    "ENVIRONMENT",
    "FAKE_MODEL_NAME",
    "GYM_SERVERS",
    "HOST",
    "MODEL",
    "PORT_OFFSETS",
    "PORT_SPAN",
    "RESOURCES",
    "TOKEN_ENV",
    "WRAP_ENTRYPOINT",
    "REPLICATED",
    "build_gym_config",
    "gym_servers",
    "port_span",
    "replica_name",
    "replica_port_offsets",
    "rollout_body",
    "server_location",
    "wrapped_entrypoints",
]

HOST = "127.0.0.1"
BACKEND = "fake_backend"
MODEL = "policy_model"
AGENT = "simple_agent"
RESOURCES = "example_single_tool_call"
ENVIRONMENT = "single_agent_turn"
GYM_SERVERS = (MODEL, AGENT, RESOURCES, ENVIRONMENT)
PORT_OFFSETS = {BACKEND: 0, MODEL: 1, AGENT: 2, RESOURCES: 3, ENVIRONMENT: 4}
_HEAD_SERVER_OFFSET = 5
PORT_SPAN = 6
TOKEN_ENV = "NG_CHECKPOINT_TOKEN"
DEFAULT_CHECKPOINT_BLOCK: Mapping[str, Any] = {"enabled": True, "control_auth_token_env": TOKEN_ENV}
FAKE_MODEL_NAME = "fake-model"
# The servers a replica chain repeats, in port order (each replica >= 2 takes three consecutive ports).
REPLICATED = (MODEL, AGENT, ENVIRONMENT)
_SERVER_TYPES = {MODEL: "responses_api_models", AGENT: "responses_api_agents", ENVIRONMENT: "environment_servers"}


def replica_name(name: str, replica: int) -> str:
    """The top-level name of replica ``replica`` (1-based) of ``name``: the name itself for the first."""
    if replica < 1:
        raise ValueError(f"replicas are numbered from 1, got {replica}")
    if replica > 1 and name not in REPLICATED:
        raise ValueError(f"{name} is not replicated; only {list(REPLICATED)} are")
    return name if replica == 1 else f"{name}_{replica}"


def _check_replicas(replicas: int) -> None:
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")


def gym_servers(replicas: int = 1) -> tuple[str, ...]:
    """Every Gym server's top-level name: ``GYM_SERVERS``, then replica 2's chain, replica 3's..."""
    _check_replicas(replicas)
    extra = tuple(replica_name(name, i) for i in range(2, replicas + 1) for name in REPLICATED)
    return GYM_SERVERS + extra


def replica_port_offsets(replicas: int = 1) -> dict[str, int]:
    """``{name: port offset}`` of every server (the fake backend included) of a deployment of ``replicas``."""
    _check_replicas(replicas)
    offsets = dict(PORT_OFFSETS)
    for i in range(2, replicas + 1):
        for j, name in enumerate(REPLICATED):
            offsets[replica_name(name, i)] = PORT_SPAN + len(REPLICATED) * (i - 2) + j
    return offsets


def port_span(replicas: int = 1) -> int:
    """How many consecutive ports from the base a deployment of ``replicas`` uses (``PORT_SPAN`` for one)."""
    _check_replicas(replicas)
    return PORT_SPAN + len(REPLICATED) * (replicas - 1)


# Each shipped YAML supplies its server's defaults; the overrides below only bind names, ports and the backend.
_SHIPPED_CONFIGS = (
    "responses_api_models/vllm_model/configs/vllm_model.yaml",
    "responses_api_agents/simple_agent/configs/simple_agent.yaml",
    "environment_servers/single_agent_turn/configs/single_agent_turn.yaml",
)
_DEFAULT_ENTRYPOINTS = {ENVIRONMENT: "nemo_gym_checkpoint_plugin._ray_off"}
# The wrapper module: each server a checkpoint participant when the block is enabled (Ray off either way).
WRAP_ENTRYPOINT = "nemo_gym_checkpoint_plugin.wrap"


def wrapped_entrypoints() -> dict[str, str]:
    """``entrypoints=`` that run every Gym server of the deployment through the wrapper.

    In the form Gym's own launcher (``ng_run``) starts too, ``-mnemo_gym_checkpoint_plugin.wrap``
    (``ng-checkpoint enable`` writes the same), so the config ``make serve`` writes runs under ``ng_run``.
    """
    from ..cli._enable import LAUNCH_ENTRYPOINT

    return dict.fromkeys(GYM_SERVERS, LAUNCH_ENTRYPOINT)


def server_location(config: Any, name: str) -> tuple[str, str, Any]:
    """``(server type, implementation, inner config)`` of the top-level server ``name``."""
    (server_type,) = config[name].keys()
    (implementation,) = config[name][server_type].keys()
    return server_type, implementation, config[name][server_type][implementation]


def _server_ref(server_type: str, name: str) -> dict[str, str]:
    return {"type": server_type, "name": name}


def build_gym_config(
    port_base: int,
    work_dir: Path,
    *,
    checkpoint: Mapping[str, Any] | None = DEFAULT_CHECKPOINT_BLOCK,
    entrypoints: Mapping[str, str] | None = None,
    model: Mapping[str, Any] | None = None,
    resources: Mapping[str, Any] | None = None,
    gym_settings: Mapping[str, Any] | None = None,
    replicas: int = 1,
    environment: Mapping[str, Any] | None = None,
    hosts: Mapping[str, str] | None = None,
) -> Any:
    """The full Gym global config (an OmegaConf ``DictConfig``) for the deployment at ``port_base``.

    ``checkpoint`` is written verbatim as the top-level ``checkpoint:`` block (None: no block).
    ``model`` adds keys to the policy model's block (e.g. ``return_token_id_information: true``).
    ``results_dir`` and ``cache_dir`` live under ``work_dir`` so nothing lands in the cwd.
    ``resources`` changes the resources server (still named ``RESOURCES``): its
    ``implementation`` (default ``example_single_tool_call``), every other key merged into its
    block (e.g. ``checkpoint_session_state``).
    ``gym_settings`` adds top-level Gym settings (e.g. ``global_aiohttp_connector_limit_per_host``).
    ``environment`` adds keys to the environment server's block (e.g. ``cleanup_timeout_seconds``: 30
    here, for tests that fail fast; Gym ships 180).
    ``replicas`` runs that many model -> agent -> environment chains (see the module docstring);
    ``entrypoints``, ``model`` and ``environment`` apply to every replica of the server they name.
    ``hosts`` (``{name: address}``) puts servers (the fake backend included) on other addresses than
    127.0.0.1: a deployment split across hosts (each server binds, and is called at, its own).
    """
    from nemo_gym.global_config import GlobalConfigDictParser, GlobalConfigDictParserConfig
    from omegaconf import OmegaConf

    offsets = replica_port_offsets(replicas)

    def port(name: str) -> dict[str, Any]:
        return {"host": (hosts or {}).get(name, HOST), "port": port_base + offsets[name]}

    chosen = {**_DEFAULT_ENTRYPOINTS, **(entrypoints or {})}
    unknown = set(chosen) - set(GYM_SERVERS)
    if unknown:
        raise ValueError(f"entrypoints name unknown servers {sorted(unknown)}; known: {list(GYM_SERVERS)}")
    resources_ref = _server_ref("resources_servers", RESOURCES)
    resources_block = dict(resources or {})
    implementation = str(resources_block.pop("implementation", "example_single_tool_call"))
    initial: dict[str, Any] = {
        "config_paths": list(_SHIPPED_CONFIGS),
        "policy_base_url": f"http://{(hosts or {}).get(BACKEND, HOST)}:{port_base + PORT_OFFSETS[BACKEND]}/v1",
        "policy_api_key": "fake-key",
        "policy_model_name": FAKE_MODEL_NAME,
        MODEL: {
            "responses_api_models": {
                "vllm_model": {
                    **port(MODEL),
                    "return_token_id_information": False,
                    "uses_reasoning_parser": False,
                    **(model or {}),
                }
            }
        },
        AGENT: {"responses_api_agents": {"simple_agent": {**port(AGENT), "resources_server": resources_ref}}},
        RESOURCES: {
            "resources_servers": {
                implementation: {
                    **port(RESOURCES),
                    "entrypoint": "app.py",
                    "domain": "agent",
                    "verified": False,
                    "description": "Basic single-step tool calling",
                    **resources_block,
                }
            }
        },
        ENVIRONMENT: {
            "environment_servers": {
                "single_agent_turn": {
                    **port(ENVIRONMENT),
                    "resources_server": resources_ref,
                    "agent_server": _server_ref("responses_api_agents", AGENT),
                    "resources_tool_transports": ["direct_http"],
                    "default_episode_timeout_seconds": 3600,
                    "cleanup_timeout_seconds": 30,
                    **(environment or {}),
                }
            }
        },
        "head_server": {"host": HOST, "port": port_base + _HEAD_SERVER_OFFSET},
        "results_dir": str(work_dir / "results"),
        "cache_dir": str(work_dir / "cache"),
    }
    for i in range(2, replicas + 1):
        model_i, agent_i, env_i = (replica_name(name, i) for name in (MODEL, AGENT, ENVIRONMENT))
        # Gym's `_copy` takes the first replica's merged block (shipped defaults and the overrides
        # above) and merges these on top: its own port, and the next server of its own chain.
        initial[model_i] = {"_copy": MODEL, "responses_api_models": {"vllm_model": port(model_i)}}
        initial[agent_i] = {
            "_copy": AGENT,
            "responses_api_agents": {
                "simple_agent": {**port(agent_i), "model_server": _server_ref(_SERVER_TYPES[MODEL], model_i)}
            },
        }
        initial[env_i] = {
            "_copy": ENVIRONMENT,
            "environment_servers": {
                "single_agent_turn": {**port(env_i), "agent_server": _server_ref(_SERVER_TYPES[AGENT], agent_i)}
            },
        }
    if checkpoint is not None:
        initial["checkpoint"] = dict(checkpoint)
    initial.update(gym_settings or {})
    config = GlobalConfigDictParser().parse(
        GlobalConfigDictParserConfig(
            initial_global_config_dict=OmegaConf.create(initial),
            skip_load_from_cli=True,
            skip_load_from_dotenv=True,
            offline=True,
        )
    )
    for name, entrypoint in chosen.items():
        for i in range(1, (replicas if name in REPLICATED else 1) + 1):
            server_location(config, replica_name(name, i))[2]["entrypoint"] = entrypoint
    return config


def rollout_body(
    rollout_id: str,
    *,
    attempt: int = 0,
    prompt: str | None = None,
    taskset: str = RESOURCES,
    task_id: str | None = None,
) -> dict[str, Any]:
    """The ``/run`` body Gym's rollout collection sends ``single_agent_turn`` for one episode attempt.

    The user message names the rollout, so the fake backend counts each rollout as its own conversation.
    """
    user = prompt if prompt is not None else f"what's it like in sf? (rollout {rollout_id})"
    weather_tool = {
        "type": "function",
        "name": "get_weather",
        "description": "",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": ""}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    return {
        "episode_id": {"rollout_id": rollout_id, "attempt": attempt},
        "task": {
            "task_id": {"taskset": taskset, "task_id": task_id or rollout_id},
            "task_input": {
                "responses_create_params": {
                    "input": [
                        {"role": "developer", "content": "You are a helpful personal assistant."},
                        {"role": "user", "content": user},
                    ],
                    "tools": [weather_tool],
                }
            },
        },
    }
