"""Find the participants of a deployment: from a Gym config or a list of URLs, by probing ``status``.

Gym finds a server's URL from its top-level block: ``<name>: {<server type>:
{<implementation>: {host, port, ...}}}`` with server types
``responses_api_models``, ``resources_servers``, ``responses_api_agents`` and
``environment_servers`` (``ServerClient._build_server_base_url``). A config
whose blocks have no host/port yet (Gym picks free ports at start) is resolved
through its ``head_server``, the way ``ServerClient`` does: the head server
serves the resolved config at ``GET /global_config_dict_yaml``.

Every server is probed at once, each with a few tries and a timeout per try, so
a server that is down or accepts a connection and never replies is reported
within ``tries * probe_timeout + (tries - 1) * retry_delay`` seconds, never
waited on forever. A 404 means the server runs without checkpointing (not a
participant); any other failure, a kind outside the four, or a deployment with
no model participant is reported.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from .._settings import CHECKPOINT_KEY, settings_from_global_config
from .._wire import SERVER_TYPES
from ._errors import NO_MODEL_PARTICIPANT, TIMEOUT, UNKNOWN_KIND, UNREACHABLE, ParticipantFailure
from ._order import KINDS
from ._transport import CallFailed, ControlTransport, Endpoint

__all__ = ["Participant", "Probe", "endpoints_from_config", "load_config", "probe_all", "token_from_config"]

HEAD_SERVER = "head_server"


@dataclass(frozen=True)
class Participant:
    """A server that answered ``status`` as a participant: its name, URL, kind, instance, last status."""

    name: str
    url: str
    kind: str
    instance: str
    status: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.name, self.url)


@dataclass
class Probe:
    """What probing found: participants, servers that are not participants (404), and failures."""

    participants: list[Participant] = field(default_factory=list)
    non_participants: list[Endpoint] = field(default_factory=list)
    failures: list[ParticipantFailure] = field(default_factory=list)


def _plain(config: Any) -> Any:
    """An OmegaConf node (Gym's global config) as plain containers; anything else as it is."""
    if type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(config, resolve=True)
    return config


def load_config(source: Any) -> dict[str, Any]:
    """A Gym config as a plain dict, from a YAML path, a mapping, a DictConfig or a ``ServerClient``."""
    if hasattr(source, "global_config_dict"):
        source = source.global_config_dict
    if isinstance(source, str | Path):
        with open(source, encoding="utf-8") as handle:
            source = yaml.safe_load(handle) or {}
    source = _plain(source)
    if not isinstance(source, Mapping):
        raise ValueError(f"a Gym config must be a mapping, got {type(source).__name__}")
    return dict(source)


def _server_address(block: Mapping[str, Any]) -> tuple[Any, Any] | None:
    """(host, port) of a top-level server block, None when it is not a server block."""
    for server_type in SERVER_TYPES:
        implementations = block.get(server_type)
        if isinstance(implementations, Mapping) and implementations:
            inner = next(iter(implementations.values()))
            if isinstance(inner, Mapping):
                return inner.get("host"), inner.get("port")
    return None


def endpoints_from_config(config: Mapping[str, Any]) -> tuple[list[Endpoint], list[str]]:
    """Every server block with a host and port, and the names of blocks that have none."""
    endpoints, unresolved = [], []
    for name, block in config.items():
        if name in (CHECKPOINT_KEY, HEAD_SERVER) or not isinstance(block, Mapping):
            continue
        address = _server_address(block)
        if address is None:
            continue
        host, port = address
        if host in (None, "") or port in (None, ""):
            unresolved.append(str(name))
            continue
        endpoints.append(Endpoint(str(name), f"http://{host}:{port}"))
    return endpoints, unresolved


async def resolve_through_head_server(config: Mapping[str, Any], timeout: float) -> dict[str, Any] | None:
    """The resolved config the head server serves, or None when there is no head server block."""
    head = config.get(HEAD_SERVER)
    if not isinstance(head, Mapping) or not head.get("host") or not head.get("port"):
        return None
    url = f"http://{head['host']}:{head['port']}/global_config_dict_yaml"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.get(url) as response:
            response.raise_for_status()
            # Gym serves JSON text under this name (ServerClient reads it with json.loads).
            return dict(orjson.loads(await response.read()))


def token_from_config(config: Mapping[str, Any]) -> str | None:
    """The bearer token the ``checkpoint:`` block resolves to (from its env var), or None without a block.

    Raises ``SettingsError`` naming the key when the block is there but gives no token.
    """
    if CHECKPOINT_KEY not in config:
        return None
    return settings_from_global_config(config).resolve_token()


async def _probe_one(
    transport: ControlTransport, endpoint: Endpoint, *, probe_timeout: float, tries: int, retry_delay: float
) -> Participant | Endpoint | ParticipantFailure:
    failure: ParticipantFailure | None = None
    for attempt in range(max(tries, 1)):
        if attempt:
            # Back off between tries: a server that is still starting gets a moment to bind.
            await asyncio.sleep(retry_delay)
        try:
            status = await transport.call(endpoint, "status", None, timeout=probe_timeout)
        except CallFailed as exc:
            failure = exc.failure
            if failure.status == 404:
                return endpoint
            if failure.code in (UNREACHABLE, TIMEOUT):
                continue
            return failure
        kind, instance = status.get("kind"), status.get("instance")
        if kind not in KINDS:
            return ParticipantFailure(
                endpoint.name,
                endpoint.url,
                "status",
                UNKNOWN_KIND,
                f"status names kind {kind!r}, not one of {', '.join(KINDS)}",
            )
        if not isinstance(instance, str) or not instance:
            instance = endpoint.name
        return Participant(endpoint.name, endpoint.url, kind, instance, status)
    assert failure is not None
    detail = f"{failure.detail} (after {tries} tries, {probe_timeout:.1f}s each)"
    return ParticipantFailure(failure.server, failure.url, "status", failure.code, detail, failure.status)


async def probe_all(
    transport: ControlTransport,
    endpoints: Sequence[Endpoint],
    *,
    probe_timeout: float = 2.0,
    tries: int = 3,
    retry_delay: float = 0.25,
) -> Probe:
    """Probe every endpoint's ``status`` at once; bounded by ``tries`` timeouts plus back-offs."""
    outcomes = await asyncio.gather(
        *(
            _probe_one(transport, endpoint, probe_timeout=probe_timeout, tries=tries, retry_delay=retry_delay)
            for endpoint in endpoints
        )
    )
    probe = Probe()
    for outcome in outcomes:
        if isinstance(outcome, Participant):
            probe.participants.append(outcome)
        elif isinstance(outcome, Endpoint):
            probe.non_participants.append(outcome)
        else:
            probe.failures.append(outcome)
    if not any(p.kind == "model" for p in probe.participants):
        probe.failures.append(
            ParticipantFailure(
                "(deployment)",
                "",
                "discover",
                NO_MODEL_PARTICIPANT,
                f"no participant of kind 'model' among {len(probe.participants)} participant(s): "
                "the policy model server must run with checkpoint.enabled",
            )
        )
    return probe
