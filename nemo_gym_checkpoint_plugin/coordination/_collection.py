"""Gym's own rollout collection, composed into a checkpoint controller.

``CheckpointingCollectionHelper`` subclasses nemo-gym's ``RolloutCollectionHelper`` and
changes only what a checkpoint controller must (everything else, preprocessing,
``resume_from_cache``, dispatch, the output files, metrics, is Gym's code):

- ``setup_server_client`` returns a ``CollectorServerClient``: Gym's ``ServerClient`` that
  sends each ``/run`` at most once (Gym's request loop resends an internal call after a
  dropped connection: after a crash that starts the same attempt twice beside its restored
  copy), decodes an explicit ``"<id>-aN"`` rollout id of an episode request as attempt N of
  ``<id>`` (Gym's ``_episode_request_body`` sends it as attempt 0 of ``"<id>-aN"``, which
  every server refuses), and tells a ``RunTracker`` which episode attempts are in flight.
  Without a reachable head server it uses the collector's own config (the servers' addresses
  are in it), so a deployment run without Gym's head server can be collected from. A ``/run``
  refused ``409 attempt_running`` (that attempt already runs there: it lives elsewhere) resolves
  to Gym's own no-persist result, as a row drained by the dispatch budget does: written neither
  to the output nor to the failures sidecar (so never a terminal failure), noted by the tracker
  (``elsewhere``), and dispatched again by a ``--resume``. Any other typed refusal of any call
  (``stale_attempt`` for a row a leftover mark refuses, ...) reaches Gym as ``Refused``: the
  error Gym raises or records then reads ``<code>: <detail>``, never a bare ``409 Conflict``.
- ``_load_from_cache`` (Gym's ``resume_from_cache``) then sets each row's attempt: a row the
  checkpoint continued goes out as the replacement attempt the restore installed, a row a
  failed restore retired starts over past the retired attempts.
- ``run_from_config`` keeps the token capture the restore installed: before dispatch Gym
  clears the token capture of every row it is about to send (a reused key would merge two
  attempts), which for a continued row is the replacement attempt's restored calls; Gym's
  trainer rebuild would then miss them and mask the sample. Every other row is cleared as
  Gym clears it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import nemo_gym.rollout_collection as gym_collection
import orjson
from aiohttp import ClientError, ClientResponseError
from nemo_gym.failure_kinds import CANCELLED
from nemo_gym.global_config import (
    ATTEMPT_INDEX_KEY_NAME,
    ROLLOUT_ID_KEY_NAME,
    ROLLOUT_INDEX_KEY_NAME,
    TASK_INDEX_KEY_NAME,
    get_global_config_dict,
)
from nemo_gym.rollout_collection import NG_FAILURE_CLASS_KEY, NG_NO_PERSIST_KEY, RolloutCollectionHelper
from nemo_gym.rollout_correlation import maybe_rollout_id_from_run_body
from nemo_gym.server_utils import (
    BaseServerConfig,
    GlobalAIOHTTPAsyncClientConfig,
    ServerClient,
    is_global_aiohttp_client_setup,
    set_global_aiohttp_client,
)
from pydantic import PrivateAttr

from .._identity import capture_key, episode_to_wire, from_capture_key, make_episode_id
from ._errors import ATTEMPT_RUNNING
from ._gym_client import ControllerServerClient, is_run_call

__all__ = [
    "CheckpointingCollectionHelper",
    "CollectorServerClient",
    "LivesElsewhere",
    "RunTracker",
    "decode_explicit_attempt",
    "episode_of_run",
    "row_rollout_id",
]


def decode_explicit_attempt(body: Any) -> Any:
    """An episode request whose ``episode_id.rollout_id`` ends in ``-aN`` as attempt N of the prefix.

    Attempt 0 next to the suffix is how Gym's ``_episode_request_body`` sends an explicit id
    (it never has another attempt for it), so it means "no attempt index"; a suffix *and* a
    non-zero attempt is ambiguous and refused (``AmbiguousEpisodeId``, a ``ValueError``)
    before anything is sent. Any other body is returned as it is.
    """
    if not isinstance(body, Mapping) or not isinstance(body.get("episode_id"), Mapping):
        return body
    episode_id = body["episode_id"]
    rollout_id, attempt = episode_id.get("rollout_id"), episode_id.get("attempt", 0)
    if not isinstance(rollout_id, str) or not isinstance(attempt, int):
        return body
    decoded = make_episode_id(rollout_id, None if attempt == 0 else attempt)
    if decoded.rollout_id == rollout_id:
        return body
    return {**body, "episode_id": {**episode_id, **episode_to_wire(decoded)}}


def episode_of_run(body: Any) -> tuple[str, int] | None:
    """``(rollout_id, attempt)`` a ``/run`` body names: its ``episode_id``, else Gym's key of a flat row."""
    if not isinstance(body, Mapping):
        return None
    episode_id = body.get("episode_id")
    if isinstance(episode_id, Mapping):
        rollout_id, attempt = episode_id.get("rollout_id"), episode_id.get("attempt", 0)
        return (rollout_id, attempt) if isinstance(rollout_id, str) and isinstance(attempt, int) else None
    try:
        key = maybe_rollout_id_from_run_body(body)
        episode = None if key is None else from_capture_key(key)
    except (TypeError, ValueError):
        return None
    return None if episode is None else (episode.rollout_id, episode.attempt)


def row_rollout_id(row: Mapping[str, Any]) -> str:
    """The rollout id Gym gives a row on the wire (its explicit id decoded, else ``<task>-<rollout>``)."""
    base = {**row, ATTEMPT_INDEX_KEY_NAME: 0}
    key = maybe_rollout_id_from_run_body(base) or f"{row[TASK_INDEX_KEY_NAME]}-{row[ROLLOUT_INDEX_KEY_NAME]}"
    return from_capture_key(key).rollout_id


def _capture_key(row: Any) -> str | None:
    """The capture key Gym gives a row (as its clear before dispatch computes it), or None."""
    try:
        return maybe_rollout_id_from_run_body(row)
    except (TypeError, ValueError):
        return None


class RunTracker:
    """The ``/run`` calls in flight, by rollout id, and the rollouts whose ``/run`` returned."""

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}
        self.returned = 0
        self.failed = 0
        self.final: list[str] = []
        # Rollouts whose /run was refused attempt_running: that attempt lives elsewhere, unrecorded here.
        self.elsewhere: list[str] = []
        # Rows a restore put back that Gym has not dispatched yet: rollout id -> (attempt, collector row
        # state). A continued row's attempt is the replacement the restore installed (pending on the
        # servers); a row starting over keeps its checkpointed attempt and state. The next checkpoint
        # carries them (CollectionCheckpointer), so a crash before their dispatch loses none.
        self.awaiting: dict[str, tuple[int, str]] = {}
        self.on_change: Callable[[], None] | None = None

    def started(self, rollout_id: str, attempt: int) -> None:
        self.in_flight[rollout_id] = attempt
        self.awaiting.pop(rollout_id, None)
        if self.on_change is not None:
            self.on_change()

    def ended(self, rollout_id: str, ok: bool, elsewhere: bool = False) -> None:
        self.in_flight.pop(rollout_id, None)
        if ok:
            self.returned += 1
            self.final.append(rollout_id)
        elif elsewhere:
            self.elsewhere.append(rollout_id)
        else:
            self.failed += 1
        if self.on_change is not None:
            self.on_change()

    def episodes(self) -> list[dict[str, Any]]:
        return [{"rollout_id": r, "attempt": a} for r, a in self.in_flight.items()]

    def take_final(self) -> list[str]:
        final, self.final = self.final, []
        return final


class LivesElsewhere:
    """The reply Gym's collection gets for a ``/run`` refused ``attempt_running``: Gym's no-persist result.

    Gym reads a ``/run`` reply through ``raise_for_status`` (``ok``), ``get_response_json``
    (``read``) and, on its error path, ``release``: this answers those with the result Gym builds
    for a row its dispatch budget drained (``_ng_no_persist``: no row in any file, so a resume
    dispatches it again), instead of the refusal, which Gym would turn into the end of the run.
    """

    status = 200
    ok = True

    def __init__(self, rollout_id: str, detail: str) -> None:
        self._body = orjson.dumps(
            {
                NG_FAILURE_CLASS_KEY: CANCELLED,
                NG_NO_PERSIST_KEY: True,
                "error_message": f"rollout {rollout_id}: {detail} (not recorded here: it lives elsewhere)",
            }
        )

    async def read(self) -> bytes:
        return self._body

    def release(self) -> None:
        return None


class Refused:
    """A typed refusal (``{"error": {"code", "detail"}}``) as Gym's collection reads a failed reply.

    Gym turns a failed reply into ``aiohttp``'s ``ClientResponseError``, whose text is the HTTP
    reason alone (``409, message='Conflict'``): nothing says which rollout or why. This answers
    ``raise_for_status`` with the same error class and status, its message ``<code>: <detail>``,
    and the body for Gym's failure row, so the collection's error (or its failures sidecar) names
    the refusal. Everything else is the response's own.
    """

    ok = False

    def __init__(self, response: Any, body: bytes, code: str, detail: str) -> None:
        self._response = response
        self._body = body
        self.status = response.status
        self.reason = f"{code}: {detail}"
        self.content = self  # Gym's raise_for_status reads ``response.content.read()``

    def __getattr__(self, name: str) -> Any:
        return getattr(self._response, name)

    def raise_for_status(self) -> None:
        raise ClientResponseError(
            self._response.request_info,
            self._response.history,
            status=self.status,
            message=self.reason,
            headers=self._response.headers,
        )

    async def read(self) -> bytes:
        return self._body

    def release(self) -> None:
        self._response.release()


async def _typed_refusal(response: Any) -> Refused | None:
    """A failed reply carrying the protocol's error body as a ``Refused``, else None (the body is cached)."""
    try:
        body = await response.read()
        error = orjson.loads(body).get("error")
    except (ValueError, AttributeError, ClientError):
        return None
    if not isinstance(error, dict) or not isinstance(error.get("code"), str):
        return None
    return Refused(response, body, error["code"], str(error.get("detail") or ""))


async def _running_elsewhere(response: Any) -> str | None:
    """The detail of a ``409 attempt_running`` refusal, else None (the response is left unread)."""
    if response.status != 409:
        return None
    try:
        error = orjson.loads(await response.read()).get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(error, dict) or error.get("code") != ATTEMPT_RUNNING:
        return None
    return str(error.get("detail") or "the attempt is already running there")


class CollectorServerClient(ControllerServerClient):
    """The public ``ControllerServerClient`` (``/run`` made once); explicit ``-aN`` ids decoded, calls tracked."""

    _tracker: RunTracker | None = PrivateAttr(default=None)

    def track(self, tracker: RunTracker) -> CollectorServerClient:
        self._tracker = tracker
        return self

    async def request(self, server_name: str, url_path: str, method: str, **kwargs: Any) -> Any:
        if not is_run_call(method, url_path):
            response = await super().request(server_name=server_name, url_path=url_path, method=method, **kwargs)
            if not response.ok and (refused := await _typed_refusal(response)) is not None:
                return refused
            return response
        body = decode_explicit_attempt(kwargs.get("json"))
        kwargs["json"] = body
        episode = episode_of_run(body)
        tracker = self._tracker
        if tracker is not None and episode is not None:
            tracker.started(*episode)
        ok = elsewhere = False
        try:
            response = await super().request(server_name=server_name, url_path=url_path, method=method, **kwargs)
            ok = response.ok
            if ok:
                # The row is final once its reply is read; reading it here keeps that inside the tracking.
                await response.read()
            elif episode is not None and (detail := await _running_elsewhere(response)) is not None:
                elsewhere = True
                return LivesElsewhere(episode[0], detail)
            elif (refused := await _typed_refusal(response)) is not None:
                return refused
            return response
        finally:
            if tracker is not None and episode is not None:
                tracker.ended(episode[0], ok, elsewhere)


class CheckpointingCollectionHelper(RolloutCollectionHelper):
    """Gym's ``RolloutCollectionHelper`` as a checkpoint controller's collector (see the module docstring)."""

    _tracker: RunTracker = PrivateAttr(default_factory=RunTracker)
    _attempts: dict[str, int] = PrivateAttr(default_factory=dict)
    _restored: set[str] = PrivateAttr(default_factory=set)
    _total: int = PrivateAttr(default=0)
    _done_before: int = PrivateAttr(default=0)
    _started_at: float = PrivateAttr(default_factory=time.monotonic)

    @property
    def tracker(self) -> RunTracker:
        return self._tracker

    @property
    def total(self) -> int:
        return self._total

    @property
    def done_before(self) -> int:
        return self._done_before

    def set_attempts(self, attempts: Mapping[str, int], restored: Iterable[str] = ()) -> None:
        """Rollout id -> the attempt its row goes out as (rows not named keep Gym's); ``restored``: the
        capture keys whose token capture a restore installed (kept when Gym clears before dispatch)."""
        self._attempts = dict(attempts)
        self._restored = set(restored)

    async def run_from_config(self, config: Any) -> Any:
        gym_clear = gym_collection.clear_token_captures_for_rollouts
        restored = self._restored

        def clear(records: list[Any], directories: list[Any]) -> None:
            gym_clear([r for r in records if _capture_key(r) not in restored], directories)

        # Gym's run looks the function up in its module at the call: swapped for this run only.
        gym_collection.clear_token_captures_for_rollouts = clear
        try:
            return await super().run_from_config(config)
        finally:
            gym_collection.clear_token_captures_for_rollouts = gym_clear

    def setup_server_client(self, head_server_config: BaseServerConfig | None = None) -> ServerClient:
        try:
            gym = super().setup_server_client(head_server_config)
            client = CollectorServerClient(
                head_server_config=gym.head_server_config, global_config_dict=gym.global_config_dict
            )
        except (ValueError, OSError):
            # No head server answered: the collector's config names every server itself.
            config = get_global_config_dict()
            head = head_server_config or BaseServerConfig.model_validate(config["head_server"])
            client = CollectorServerClient(head_server_config=head, global_config_dict=config)
            if not is_global_aiohttp_client_setup():
                set_global_aiohttp_client(cfg=GlobalAIOHTTPAsyncClientConfig.model_validate(config))
        return client.track(self._tracker)

    def _preprocess_rows_from_config(self, config: Any) -> list[dict]:
        rows = super()._preprocess_rows_from_config(config)
        self._total, self._done_before = len(rows), 0
        return rows

    def _load_from_cache(self, config: Any, **kwargs: Any) -> Any:
        input_rows, rows, results, result_strs = super()._load_from_cache(config, **kwargs)
        done = len(kwargs["success_keys"]) if kwargs.get("success_keys") is not None else len(results)
        self._total, self._done_before = len(input_rows) + done, done
        continued_first = []
        others = []
        for row in input_rows:
            rollout_id = row_rollout_id(row)
            attempt = self._attempts.get(rollout_id)
            if attempt is None:
                others.append(row)
                continue
            attempt = max(attempt, int(row.get(ATTEMPT_INDEX_KEY_NAME) or 0))
            explicit = row.get(ROLLOUT_ID_KEY_NAME)
            if isinstance(explicit, str) and from_capture_key(explicit).rollout_id != explicit:
                # An explicit "<id>-aN" names its attempt itself; an attempt index beside it is ambiguous.
                row[ROLLOUT_ID_KEY_NAME] = capture_key(rollout_id, attempt)
                row.pop(ATTEMPT_INDEX_KEY_NAME, None)
            elif attempt:
                row[ATTEMPT_INDEX_KEY_NAME] = attempt
            continued_first.append(row)
        # Rows the restore is waiting for go first: their restored state is ready to continue.
        return continued_first + others, rows, results, result_strs
