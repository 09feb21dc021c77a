"""The controller-side coordination library.

A training controller (NeMo RL, Gym's rollout collection, the ``ng-checkpoint``
CLI) drives a deployment with::

    coordinator = await discover("gym_config.yaml", auth_token)   # or a ServerClient, a dict, URLs
    async with coordinator:
        result = await prepare(coordinator, "step-120", timeout=60)
        if result.ready:
            scope = result.continued(in_flight_episode_ids)
            await commit(coordinator, "step-120", "/ckpt/step-120", scope)
        await resume(coordinator, "step-120")

On a preemption notice (a SIGTERM, a drain notice), ``checkpoint_now`` takes one checkpoint at once
within a budget (prepare, commit, publish, always resume; nothing published when the budget ends
first or the task is cancelled)::

    now = await checkpoint_now(coordinator, "step-121", "/ckpt/step-121", in_flight_episode_ids, budget=30)
    if now.published:
        ...  # record /ckpt/step-121 and now.scope as the checkpoint to restore from

Orders, pools, bounds and failure handling are those of docs/protocol.md's
"Coordination order"; every failure is a ``CoordinationError`` naming each
failing server and its code.

A controller that dispatches rollouts through Gym's own client uses
``ControllerServerClient`` (Gym's ``ServerClient``, never resending a ``/run``) or
``ControllerCollectionHelper`` (Gym's ``RolloutCollectionHelper`` on that client), and
``row_at_attempt`` / ``row_episode`` to send a restored rollout as its next attempt
(``_gym_client.py``; docs/trainer.md). They are imported on first use: they load Gym's
rollout collection.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import aiohttp

from ._checkpoint_now import DEFAULT_BUDGET, CheckpointNow, checkpoint_now
from ._coordinator import DEFAULT_TIMEOUT, Coordinator, Progress
from ._discovery import (
    Participant,
    endpoints_from_config,
    load_config,
    probe_all,
    resolve_through_head_server,
    token_from_config,
)
from ._errors import UNRESOLVED_ADDRESS, CoordinationError, ParticipantFailure
from ._ledger import LostWork, ledger_counts, lost_work
from ._order import KINDS, DefaultCoordinationOrder, default_order, stages_for
from ._results import CommitResult, PrepareResult, RestoreResult, capture_key, wire_episode_id
from ._transport import ControlTransport, Endpoint, encode_body

# Loaded on first use (PEP 562): they import Gym's rollout collection, which the rest does not need.
_GYM_CLIENT_NAMES = frozenset(
    {"ControllerCollectionHelper", "ControllerServerClient", "is_run_call", "row_at_attempt", "row_episode"}
)


def __getattr__(name: str) -> Any:
    if name in _GYM_CLIENT_NAMES:
        from . import _gym_client

        return getattr(_gym_client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_TIMEOUT",
    "KINDS",
    "CheckpointNow",
    "CommitResult",
    "ControlTransport",
    "ControllerCollectionHelper",
    "ControllerServerClient",
    "CoordinationError",
    "DefaultCoordinationOrder",
    "Coordinator",
    "Endpoint",
    "LostWork",
    "Participant",
    "ParticipantFailure",
    "PrepareResult",
    "Progress",
    "RestoreResult",
    "capture_key",
    "checkpoint_now",
    "commit",
    "default_order",
    "discover",
    "encode_body",
    "forget",
    "is_run_call",
    "ledger_counts",
    "load_config",
    "lost_work",
    "prepare",
    "renew",
    "restore",
    "resume",
    "retire",
    "row_at_attempt",
    "row_episode",
    "stages_for",
    "token_from_config",
    "wire_episode_id",
]


def _is_url_list(source: Any) -> bool:
    if isinstance(source, str):
        return source.startswith(("http://", "https://"))
    return isinstance(source, Sequence) and all(isinstance(item, str) for item in source)


def _named_by_instance(participants: list[Participant]) -> list[Participant]:
    """Servers given by URL are named by the instance their status reports (the URL when two share one)."""
    counts: dict[str, int] = {}
    for participant in participants:
        counts[participant.instance] = counts.get(participant.instance, 0) + 1
    return [replace(p, name=p.instance) if counts[p.instance] == 1 else p for p in participants]


async def discover(
    config_or_client: Any,
    auth_token: str | None = None,
    *,
    probe_timeout: float = 2.0,
    tries: int = 3,
    retry_delay: float = 0.25,
    strict: bool = True,
    pm: Any = None,
    reply_grace: float = 10.0,
    control_limit_per_host: int = 4,
) -> Coordinator:
    """Probe every server of a deployment and return its ``Coordinator``.

    ``config_or_client`` is a Gym config (a YAML path, a mapping or DictConfig, or a
    ``ServerClient``) or URLs (one string or a list). Participants are named by their
    config block, or (from URLs) by the instance their status reports; a server that
    never answered is named by its block or URL. Without ``auth_token`` the config's
    ``checkpoint:`` block gives it (through its environment variable).

    Every server is probed at once, ``tries`` times at most with ``probe_timeout`` seconds
    each, so the whole discovery is bounded. With ``strict`` (the default) any failure
    (a server down or hung, an unknown kind, no model participant, a config block without
    host/port) raises ``CoordinationError`` naming each server and its code; otherwise the
    coordinator carries them in ``failures``. ``pm`` is the plugin manager whose
    ``coordination_order`` hook gives the orders; by default ``_order.order_manager()``
    (the default order plus the ``nemo_gym_checkpoint`` entry-point group), so an installed
    plugin can reorder a deployment.
    """
    if pm is None:
        from ._order import order_manager

        pm = order_manager()
    failures: list[ParticipantFailure] = []
    from_urls = _is_url_list(config_or_client)
    if from_urls:
        urls = [config_or_client] if isinstance(config_or_client, str) else list(config_or_client)
        endpoints = [Endpoint(url.rstrip("/"), url.rstrip("/")) for url in urls]
    else:
        config = load_config(config_or_client)
        endpoints, unresolved = endpoints_from_config(config)
        why = "the config gives this server no host/port and it has no head_server block to resolve it"
        if unresolved:
            try:
                resolved = await resolve_through_head_server(config, probe_timeout * tries)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                # Words, not a repr: the CLI shows this detail as it is.
                answer = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                resolved, why = None, f"no host/port in the config, and its head server did not answer ({answer})"
            if resolved is not None:
                config = resolved
                endpoints, unresolved = endpoints_from_config(config)
                why = "no host/port in the config, nor in the config its head server serves"
        failures += [ParticipantFailure(name, "", "discover", UNRESOLVED_ADDRESS, why) for name in unresolved]
        if auth_token is None:
            auth_token = token_from_config(config)
    transport = ControlTransport(auth_token, limit_per_host=control_limit_per_host)
    try:
        probe = await probe_all(transport, endpoints, probe_timeout=probe_timeout, tries=tries, retry_delay=retry_delay)
    except BaseException:
        await transport.close()
        raise
    failures += probe.failures
    if from_urls:
        probe.participants = _named_by_instance(probe.participants)
    if strict and failures:
        await transport.close()
        raise CoordinationError("discover", failures)
    return Coordinator(
        probe.participants,
        transport,
        pm=pm,
        reply_grace=reply_grace,
        failures=failures,
        non_participants=probe.non_participants,
    )


async def prepare(coordinator: Coordinator, checkpoint_id: str, **kwargs: Any) -> PrepareResult:
    """``Coordinator.prepare``: staged prepare, stopping at the first stage not ready."""
    return await coordinator.prepare(checkpoint_id, **kwargs)


async def commit(
    coordinator: Coordinator, checkpoint_id: str, checkpoint_dir: str, episode_ids: Iterable[Any] | None, **kwargs: Any
) -> CommitResult:
    """``Coordinator.commit``: every participant at once."""
    return await coordinator.commit(checkpoint_id, checkpoint_dir, episode_ids, **kwargs)


async def resume(coordinator: Coordinator, checkpoint_id: str, **kwargs: Any) -> dict[str, dict[str, Any]]:
    """``Coordinator.resume``: reverse order, past failures, reporting them all."""
    return await coordinator.resume(checkpoint_id, **kwargs)


async def restore(
    coordinator: Coordinator, checkpoint_id: str, checkpoint_dir: str, episode_ids: Iterable[Any], **kwargs: Any
) -> RestoreResult:
    """``Coordinator.restore``: all or nothing."""
    return await coordinator.restore(checkpoint_id, checkpoint_dir, episode_ids, **kwargs)


async def retire(
    coordinator: Coordinator, checkpoint_id: str, episode_ids: Iterable[Any], **kwargs: Any
) -> dict[str, dict[str, Any]]:
    """``Coordinator.retire``: environment, agent, then model and resources."""
    return await coordinator.retire(checkpoint_id, episode_ids, **kwargs)


async def forget(
    coordinator: Coordinator, checkpoint_id: str, rollout_ids: Iterable[str], **kwargs: Any
) -> dict[str, dict[str, Any]]:
    """``Coordinator.forget``: retire's order."""
    return await coordinator.forget(checkpoint_id, rollout_ids, **kwargs)


async def renew(coordinator: Coordinator, checkpoint_id: str, **kwargs: Any) -> dict[str, float | None]:
    """``Coordinator.renew``: every participant."""
    return await coordinator.renew(checkpoint_id, **kwargs)
