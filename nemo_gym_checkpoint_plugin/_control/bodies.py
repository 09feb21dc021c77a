"""Control-route bodies: read within limits, then parse and validate them off the event loop.

A body of a million ids once held a server's event loop (data traffic too) for seconds while
pydantic validated it item by item. Here:

- the body's size is checked before it is read (``Content-Length``) and while it streams in;
  beyond ``BodyLimits.max_body_bytes`` it is refused with **413**;
- the bytes are parsed with orjson (UTF-8 JSON only, RFC 8259: a UTF-16 or otherwise
  undecodable body is a 422) and validated in a worker thread (inline up to
  ``INLINE_BODY_BYTES``, 16 KiB, where the thread hop would cost more than the work): the scalar fields by the
  route's pydantic model, the id lists in bulk with plain checks (an item that fails them is
  validated by ``EpisodeId`` itself, for its exact error); a list longer than
  ``BodyLimits.max_ids`` is refused with **422** before any item is looked at;
- an episode list comes back as ``EpisodeIds``: its pairs and sorted capture keys, computed in
  the thread too (and its ``EpisodeId`` objects when the route hands them to hooks), so a
  commit, restore or retire does no per-id work on the loop but marking.

Every refusal has the shape of FastAPI's body errors: ``{"detail": [{"type", "loc", "msg"}]}``.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from nemo_gym_checkpoint_plugin._identity import EpisodeId, capture_key, is_plain_episode

from .._types import EpisodeIds

__all__ = ["BodyLimits", "BodyRefused", "ListField", "read_body", "parse_body"]

# Bodies up to this size are validated inline: that costs less than the hop to a thread (~400 ids at most).
INLINE_BODY_BYTES = 16 * 1024
# Item errors reported per list: enough to fix a client, never a reply as big as the body.
_MAX_ITEM_ERRORS = 10
# Gym's EpisodeId rules for rollout_id (``_identity.is_plain_episode``) over rollout ids joined by
# newlines (a newline inside an id is caught by counting them).
_ROLLOUT_IDS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(?:\n[A-Za-z0-9][A-Za-z0-9._-]*)*").fullmatch
_RESERVED_SUFFIX_LINE = re.compile(r"-a[1-9][0-9]*(?:\n|\Z)").search
_EPISODE_KEYS = frozenset({"rollout_id", "attempt"})


@dataclass(frozen=True)
class BodyLimits:
    """What one control call may send. Defaults are documented in docs/protocol.md "Routes"."""

    # 64 MiB: about 1.4 million episode ids, far above max_ids' worth of any realistic id.
    max_body_bytes: int = 64 * 1024 * 1024
    # Per list (episode_ids, rollout_ids). Issue 14's 16,000-episode scopes fit 12 times over.
    max_ids: int = 200_000


@dataclass(frozen=True)
class ListField:
    """An id list of a body: ``episodes`` (wire episode ids) or rollout id strings."""

    name: str
    episodes: bool = True
    nullable: bool = False
    min_length: int = 0
    # Make the EpisodeId objects in the parsing thread (the route passes them to participant hooks).
    materialize: bool = False


class BodyRefused(Exception):
    """A body refused before it reached the control plane: ``status`` (413 or 422) and FastAPI-shaped errors."""

    def __init__(self, status: int, errors: list[dict[str, Any]]) -> None:
        super().__init__(errors)
        self.status = status
        self.errors = errors


def _error(kind: str, loc: tuple[Any, ...], msg: str) -> dict[str, Any]:
    return {"type": kind, "loc": ["body", *(str(part) for part in loc)], "msg": msg}


async def read_body(request: Request, limits: BodyLimits) -> bytes:
    """The request's bytes, refused with 413 as soon as they are known to exceed the limit."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyRefused(413, [_error("body_too_large", (), f"Content-Length {declared} exceeds {limit} bytes")])
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyRefused(413, [_error("body_too_large", (), f"the body exceeds {limit} bytes")])
    return bytes(body)


async def parse_body(
    raw: bytes, model: type[BaseModel], head: type[BaseModel], lists: tuple[ListField, ...], limits: BodyLimits
) -> Any:
    """``model`` from ``raw``, validated in a worker thread unless it is small (see the module docstring)."""
    if len(raw) <= INLINE_BODY_BYTES:
        return validate_body(raw, model, head, lists, limits)
    return await asyncio.to_thread(validate_body, raw, model, head, lists, limits)


def validate_body(
    raw: bytes, model: type[BaseModel], head: type[BaseModel], lists: tuple[ListField, ...], limits: BodyLimits
) -> Any:
    """Parse and validate (blocking): ``head`` checks every field but the ``lists``, checked in bulk here."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BodyRefused(422, [_error("json_invalid", (), f"the body is not UTF-8 JSON: {exc}")]) from None
    if not isinstance(data, dict):
        raise BodyRefused(422, [_error("model_attributes_type", (), "the body must be a JSON object")])
    errors: list[dict[str, Any]] = []
    values: dict[str, Any] = {}
    for spec in lists:
        if spec.name not in data:
            errors.append(_error("missing", (spec.name,), "Field required"))
            continue
        values[spec.name] = _check_list(spec, data.pop(spec.name), limits, errors)
    try:
        values.update(head.model_validate(data).model_dump())
    except ValidationError as exc:
        errors[:0] = [_error(str(e["type"]), tuple(e["loc"]), str(e["msg"])) for e in exc.errors()]
    if errors:
        raise BodyRefused(422, errors)
    return model.model_construct(**values)


def _check_list(spec: ListField, value: Any, limits: BodyLimits, errors: list[dict[str, Any]]) -> Any:
    if value is None and spec.nullable:
        return None
    if not isinstance(value, list):
        errors.append(_error("list_type", (spec.name,), "Input should be a valid list"))
        return None
    if len(value) > limits.max_ids:
        errors.append(
            _error(
                "too_long",
                (spec.name,),
                f"List should have at most {limits.max_ids} items (the control routes' limit), not {len(value)}",
            )
        )
        return None
    if len(value) < spec.min_length:
        errors.append(_error("too_short", (spec.name,), f"List should have at least {spec.min_length} item"))
        return None
    if spec.episodes:
        episodes = _episodes(spec.name, value, errors)
        if spec.materialize:
            episodes.materialized()
        return episodes
    for index, item in enumerate(value):
        if type(item) is not str or not item:
            errors.append(_error("string_type", (spec.name, index), "Input should be a non-empty string"))
            if len(errors) >= _MAX_ITEM_ERRORS:
                break
    return value


def _plain_episodes(items: list[Any]) -> EpisodeIds | None:
    """The whole list at once when every item has the usual shape (None: look item by item).

    ``{"rollout_id": str, "attempt": int >= 0}`` (attempt optional), with every rollout id matched
    by one regular expression over all of them joined by newlines (the pattern allows none inside
    an id) and no reserved ``-a<N>`` suffix: C-level passes instead of a few microseconds of Python
    per id, which thousands of ids in every participant's commit and restore body added up to.
    """
    try:
        rollout_ids = [item["rollout_id"] for item in items]
        attempts = [item.get("attempt", 0) for item in items]
    except (TypeError, KeyError, AttributeError):
        return None
    if not items or {type(item) for item in items} != {dict} or {type(r) for r in rollout_ids} != {str}:
        return None
    if {type(a) for a in attempts} != {int} or min(attempts) < 0:
        return None
    # Every item has rollout_id; besides it, at most attempt.
    if sum(map(len, items)) - sum(1 for item in items if "attempt" in item) != len(items):
        return None
    joined = "\n".join(rollout_ids)
    if joined.count("\n") != len(items) - 1 or _ROLLOUT_IDS(joined) is None:
        return None
    if "-a" in joined and _RESERVED_SUFFIX_LINE(joined) is not None:
        return None
    pairs = list(zip(rollout_ids, attempts, strict=True))
    if max(attempts) == 0:
        keys = set(rollout_ids)
    else:
        keys = {capture_key(r, a) for r, a in pairs}
    return EpisodeIds(pairs, tuple(sorted(keys)))


def _episodes(name: str, items: list[Any], errors: list[dict[str, Any]]) -> EpisodeIds:
    """Wire episode ids as pairs: plain checks for the usual shape, ``EpisodeId`` itself otherwise."""
    plain = _plain_episodes(items)
    if plain is not None:
        return plain
    pairs: list[tuple[str, int]] = []
    keys: set[str] = set()
    failed = 0
    for index, item in enumerate(items):
        if type(item) is dict and item.keys() <= _EPISODE_KEYS:
            # Any: is_plain_episode checks both (exact str and int) in one call on this hot path.
            rollout_id: Any = item.get("rollout_id")
            attempt: Any = item.get("attempt", 0)
            # Exactly what EpisodeId accepts unchanged; anything else goes through EpisodeId below.
            if is_plain_episode(rollout_id, attempt):
                pairs.append((rollout_id, attempt))
                keys.add(capture_key(rollout_id, attempt))
                continue
        try:
            episode = EpisodeId.model_validate(item)
        except ValidationError as exc:
            failed += 1
            if failed <= _MAX_ITEM_ERRORS:
                errors.extend(_error(str(e["type"]), (name, index, *e["loc"]), str(e["msg"])) for e in exc.errors())
            continue
        pairs.append((episode.rollout_id, episode.attempt))
        keys.add(episode.capture_key)
    return EpisodeIds(pairs, tuple(sorted(keys)))
