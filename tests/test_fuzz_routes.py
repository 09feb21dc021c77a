"""Fuzz every control route: sequences of random calls against one control plane.

Properties: no response is a 500 (an unhandled error would also surface here, since the
in-process transport re-raises app exceptions); a missing or wrong token is always a
401 ``unauthorized`` and the scheme's case never matters (``bearer``, ``BEARER``); every
non-2xx reply with a valid token is a 422 or 413 body refusal (``{"detail": [...]}``) or a
protocol error body. Bodies mix near-valid ones (which drive the phases: prepare, commit,
restore, retire...) with arbitrary JSON, raw bytes, near-valid bodies encoded as UTF-16 or
UTF-32 (always 422: the routes read UTF-8 JSON only), id lists over the limit (422) and
bodies over the byte limit (413); the harness's ``BodyLimits`` are small so these stay cheap.
A restore from tampered, special-file and duplicate checkpoints is fuzzed through the route too.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import orjson
from control_support import AUTH, INSTANCE, KIND, TOKEN, close_harness, make_harness
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from storage_support import fd_count, record
from test_storage_fuzz import tamper

from nemo_gym_checkpoint_plugin._errors import ERRORS_BY_CODE
from nemo_gym_checkpoint_plugin._routes import CONTROL_PREFIX, BodyLimits
from nemo_gym_checkpoint_plugin._storage import CheckpointWriter
from nemo_gym_checkpoint_plugin._storage.layout import participant_dir

LIMITS = BodyLimits(max_body_bytes=4096, max_ids=16)

ROUTES = ("status", "prepare", "renew", "commit", "restore", "resume", "retire", "forget")

ids = st.one_of(st.sampled_from(["c1", "c2", "restore-1"]), st.text(max_size=140))
# Offsets from "now" (computed when sent), or absolute values of any JSON type.
deadlines = st.one_of(
    st.tuples(st.just("offset"), st.floats(min_value=-5, max_value=0.3)),
    st.tuples(st.just("raw"), st.one_of(st.floats(), st.integers(), st.text(max_size=5), st.none(), st.booleans())),
)
rollouts = st.one_of(st.sampled_from(["r1", "r2", "r1-a1"]), st.text(max_size=20))
attempts = st.one_of(st.integers(min_value=-2, max_value=3), st.integers(), st.text(max_size=3), st.none())
episode = st.one_of(
    st.fixed_dictionaries({"rollout_id": rollouts, "attempt": attempts}),
    st.dictionaries(st.text(max_size=10), st.integers(), max_size=3),
)
episode_lists = st.one_of(st.none(), st.lists(episode, max_size=4), st.integers())
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.floats(), st.integers(), st.text(max_size=10)),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
dir_names = st.one_of(
    st.sampled_from(["ckpt", "other", "ckpt/sub"]),
    st.text(alphabet="abcxyz_-.", min_size=1, max_size=8).filter(lambda s: s not in {".", ".."}),
)
dirs = st.one_of(
    st.tuples(st.just("under_tmp"), dir_names),
    st.tuples(st.just("raw"), st.one_of(st.text(max_size=12).filter(lambda s: not s.startswith("/")), st.integers())),
)
# Authorized spellings: the scheme is case-insensitive (RFC 7235).
AUTHORIZED = {"valid": f"Bearer {TOKEN}", "lower": f"bearer {TOKEN}", "upper": f"BEARER {TOKEN}"}
tokens = st.one_of(
    st.sampled_from(sorted(AUTHORIZED)),
    st.just("missing"),
    st.text(max_size=30).filter(lambda t: not set(t) & set("\r\n\x00")).map(lambda t: f"Bearer {t}"),
    st.just(f"Bearer {TOKEN[:-1]}"),
    st.just(TOKEN),
)


@st.composite
def calls(draw: st.DrawFn) -> dict[str, Any]:
    route = draw(st.sampled_from(ROUTES))
    shape = draw(
        st.sampled_from(
            ["near_valid", "near_valid", "near_valid", "any_json", "raw_bytes", "wide", "huge_list", "too_big"]
        )
    )
    body: Any
    if shape in ("near_valid", "wide", "huge_list"):
        body = {"checkpoint_id": draw(ids), "deadline_ts": draw(deadlines)}
        if route in ("commit", "restore"):
            body["checkpoint_dir"] = draw(dirs)
        if route in ("commit", "restore", "retire"):
            body["episode_ids"] = draw(episode_lists)
        if route == "commit" and draw(st.booleans()):
            body["stop"] = draw(st.one_of(st.booleans(), json_values))
        if route == "forget":
            body["rollout_ids"] = draw(st.one_of(st.lists(rollouts, max_size=3), json_values))
        if draw(st.integers(0, 9)) == 0:
            body[draw(st.text(max_size=8))] = draw(json_values)
        if shape == "huge_list":
            n = draw(st.integers(LIMITS.max_ids + 1, LIMITS.max_ids + 40))
            if route == "forget":
                body["rollout_ids"] = ["r1"] * n
            else:
                body["episode_ids"] = [{"rollout_id": "r1", "attempt": 0}] * n
        if shape == "wide":
            body = ("wide", draw(st.sampled_from(["utf-16", "utf-16-le", "utf-16-be", "utf-32"])), body)
    elif shape == "too_big":
        body = b" " * draw(st.integers(LIMITS.max_body_bytes + 1, LIMITS.max_body_bytes + 5000))
    elif shape == "any_json":
        body = draw(json_values)
    else:
        body = draw(st.binary(max_size=40))
    return {"route": route, "body": body, "token": draw(tokens)}


def _resolve(value: Any, tmp: Path) -> Any:
    if isinstance(value, dict):
        return {k: _resolve(v, tmp) for k, v in value.items()}
    if isinstance(value, tuple) and value[0] == "wide":
        # Gym's json.loads would decode these; the control routes read UTF-8 only.
        return json.dumps(_resolve(value[2], tmp), allow_nan=True).encode(value[1])
    if isinstance(value, tuple):
        tag, inner = value
        if tag == "offset":
            return time.time() + inner
        if tag == "under_tmp":
            return str(tmp / inner)
        return inner
    return value


def _headers(token: str) -> dict[str, Any]:
    if token in AUTHORIZED:
        return {"Authorization": AUTHORIZED[token]}
    if token == "missing":
        return {}
    # Raw bytes: a header on the wire is bytes, not necessarily ASCII.
    return {"Authorization": token.encode()}


async def _scenario(tmp: Path, sequence: list[dict[str, Any]]) -> None:
    harness = await make_harness(tmp, retry_seconds=0.05, grace_seconds=0.05, limits=LIMITS)
    harness.participant.add("r1", "r2", "r1-a1")
    try:
        for call in sequence:
            headers = _headers(call["token"])
            authorized = call["token"] in AUTHORIZED
            url = f"{CONTROL_PREFIX}/{call['route']}"
            body = _resolve(call["body"], tmp)
            if call["route"] == "status":
                response = await harness.client.get(url, headers=headers)
            elif isinstance(body, bytes):
                response = await harness.client.post(
                    url, content=body, headers={**headers, "content-type": "application/json"}
                )
            else:
                # allow_nan: send Infinity and NaN as a lax client would.
                content = json.dumps(body, allow_nan=True).encode()
                response = await harness.client.post(
                    url, content=content, headers={**headers, "content-type": "application/json"}
                )
            assert response.status_code < 500, (call, response.status_code, response.text)
            if not authorized:
                assert response.status_code == 401, (call, response.text)
                assert response.json()["error"]["code"] == "unauthorized"
                continue
            if isinstance(call["body"], tuple) and call["body"][0] == "wide" and call["route"] != "status":
                assert response.status_code == 422, (call, response.text)
            if call["route"] != "status" and isinstance(call["body"], bytes) and len(call["body"]) > 4096:
                assert response.status_code == 413, (call, response.text)
            if response.status_code >= 400:
                _assert_a_documented_refusal(response)
            if response.status_code == 200 and call["route"] != "status":
                assert isinstance(response.json(), dict)
        # Whatever happened, the control plane still answers and phase and admission agree.
        status = (await harness.client.get(f"{CONTROL_PREFIX}/status", headers=AUTH)).json()
        if status["phase"] == "idle" and harness.plane.state.install_task is None:
            assert harness.plane.admission.is_open
        elif status["phase"] != "idle":
            assert not harness.plane.admission.is_open
    finally:
        await close_harness(harness)


def _assert_a_documented_refusal(response: Any) -> None:
    """A refusal is a body validation error (422/413, pydantic's ``detail`` list) or a typed protocol error
    (``{"error": {"code", "detail"}}``, its status the code's own: ``invalid_checkpoint_state`` is a 422 too)."""
    body = response.json()
    if "detail" in body:
        assert response.status_code in (413, 422) and isinstance(body["detail"], list), response.text
        return
    code = body["error"]["code"]
    assert ERRORS_BY_CODE[code].status == response.status_code, response.text
    assert isinstance(body["error"]["detail"], str), response.text


def test_a_typed_422_is_a_documented_refusal_too(tmp_path: Path) -> None:
    """The case the fuzzer found: a restore from a missing directory is invalid_checkpoint_state, a typed 422."""
    sequence = [
        {
            "route": "restore",
            "body": {
                "checkpoint_id": "restore-1",
                "deadline_ts": ("offset", 5),
                "checkpoint_dir": ("under_tmp", "nowhere"),
                "episode_ids": [],
            },
            "token": "valid",
        }
    ]
    asyncio.run(_scenario(tmp_path, sequence))


def test_fuzz_control_routes(tmp_path: Path) -> None:
    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(sequence=st.lists(calls(), min_size=1, max_size=6))
    def run(sequence: list[dict[str, Any]]) -> None:
        asyncio.run(_scenario(tmp_path, sequence))

    run()


def test_fuzz_reaches_the_phases(tmp_path: Path) -> None:
    """A fixed near-valid sequence, so the fuzzer's space is known to include real transitions."""
    sequence = [
        {"route": "prepare", "body": {"checkpoint_id": "c1", "deadline_ts": ("offset", 5)}, "token": "valid"},
        {
            "route": "commit",
            "body": {
                "checkpoint_id": "c1",
                "deadline_ts": ("offset", 5),
                "checkpoint_dir": ("under_tmp", "ckpt"),
                "episode_ids": None,
            },
            "token": "valid",
        },
        {"route": "resume", "body": {"checkpoint_id": "c1", "deadline_ts": ("offset", 5)}, "token": "valid"},
    ]
    asyncio.run(_scenario(tmp_path, sequence))
    assert (tmp_path / "ckpt" / "gym").is_dir()


async def _restore_tampered(tmp: Path, mutations: list, duplicate: bool) -> None:
    root = tmp / "tampered"
    shutil.rmtree(root, ignore_errors=True)
    records = [record(f"r{i}", step=i) for i in range(3)]
    if duplicate:  # a valid digest over a file that holds one episode twice
        records.append(record("r1", step=9))
    CheckpointWriter(root, KIND, INSTANCE, "c1").write(records)
    directory = participant_dir(root, KIND, INSTANCE)
    for target, how, data, position in mutations:
        path = directory / "manifest.json"
        if target == "records":
            if not path.is_file():
                continue
            try:
                path = directory / orjson.loads(path.read_bytes())["records_file"]
            except (ValueError, KeyError, TypeError):
                continue
        tamper(path, how, data, position)
    before = fd_count()
    harness = await make_harness(tmp / "harness")
    try:
        body = {
            "checkpoint_id": "re-1",
            "deadline_ts": time.time() + 20,
            "checkpoint_dir": str(root),
            "episode_ids": [{"rollout_id": f"r{i}", "attempt": 0} for i in range(3)],
        }
        # Bounded: a FIFO or a directory in a file's place must be refused, never waited on.
        response = await asyncio.wait_for(harness.client.post(f"{CONTROL_PREFIX}/restore", json=body, headers=AUTH), 30)
        status = (await harness.client.get(f"{CONTROL_PREFIX}/status", headers=AUTH)).json()
    finally:
        await close_harness(harness)
    assert response.status_code in (200, 422), response.text
    if response.status_code == 422:
        assert response.json()["error"]["code"] == "invalid_checkpoint_state"
        assert status["phase"] == "idle"
    else:
        assert not duplicate and status["phase"] == "restored"
    if duplicate and not mutations:
        assert "r1" in response.json()["error"]["detail"]
    assert fd_count() == before


TAMPERING = st.tuples(
    st.sampled_from(["manifest", "records"]),
    st.sampled_from(
        [
            "append",
            "duplicate_line",
            "flip",
            "truncate",
            "remove",
            "fifo",
            "directory",
            "symlink_out",
            "symlink_fifo",
            "bytes",
        ]
    ),
    st.binary(max_size=64) | st.sampled_from([b"\n", b"{}\n", b"null", b"7" * 300]),
    st.integers(0, 10_000),
)


def test_restore_through_the_route_refuses_special_files_and_duplicates(tmp_path: Path) -> None:
    """Special files, duplicates and tampering reach a participant only through ``restore``: always a 422
    ``invalid_checkpoint_state`` (or a clean restore of an untouched checkpoint), never a hang, a 500 or a leak."""

    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(mutations=st.lists(TAMPERING, max_size=2), duplicate=st.booleans())
    def run(mutations: list, duplicate: bool) -> None:
        asyncio.run(_restore_tampered(tmp_path, mutations, duplicate))

    run()
