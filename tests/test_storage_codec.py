from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nemo_gym_checkpoint_plugin._storage.codec import NotJSON, decode_line, encode_line

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=30,
)


def same(a: object, b: object) -> bool:
    """Equality that treats NaN as equal to NaN and checks key order and int/float types."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@given(st.dictionaries(st.text(max_size=8), json_values, max_size=8))
def test_round_trip_is_faithful_and_byte_stable(record: dict) -> None:
    line = encode_line(record)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    back = decode_line(line)
    assert same(back, record)
    assert encode_line(back) == line


def test_nan_infinities_and_big_integers_survive() -> None:
    record = {"z": 1, "a": [math.nan, math.inf, -math.inf], "big": 2**64, "neg": -(2**63) - 1, "n": None}
    line = encode_line(record)
    assert b"NaN" in line and b"-Infinity" in line and b"18446744073709551616" in line
    back = decode_line(line)
    assert list(back) == ["z", "a", "big", "neg", "n"]
    assert math.isnan(back["a"][0]) and back["a"][1:] == [math.inf, -math.inf]
    assert back["big"] == 2**64 and type(back["big"]) is int and back["neg"] == -(2**63) - 1


@pytest.mark.parametrize(
    "numbers",
    [
        [math.nan],
        [1.0, math.inf],
        [math.inf, -math.inf],  # fsum raises ValueError on this pair
        [1e308, 1e308, math.nan],  # fsum overflows before it meets the NaN
        [2**2000, -math.inf],  # an integer too large for a float, then an infinity
        [1, 2, 3, -math.inf],
        [True, 0.5, [math.nan]],
    ],
)
def test_a_non_finite_number_in_a_list_of_numbers_is_kept(numbers: list) -> None:
    record = {"episode_id": {"rollout_id": "r", "attempt": 0}, "logprobs": numbers}
    back = decode_line(encode_line(record))
    assert same(back, record)


@pytest.mark.parametrize("numbers", [[1e308, 1e308], [2**70, 1.5], list(range(5000)), [-0.0, 0.5, True]])
def test_finite_lists_whose_sum_fails_still_take_orjson_output(numbers: list) -> None:
    record = {"n": numbers}
    line = encode_line(record)
    if all(type(x) is not int or abs(x) < 2**63 for x in numbers):
        assert line == orjson.dumps(record) + b"\n"
    assert same(decode_line(line), record)


@given(
    st.lists(
        st.one_of(
            st.floats(allow_nan=True, allow_infinity=True),
            st.integers(min_value=-(2**70), max_value=2**70),
            st.booleans(),
        ),
        max_size=40,
    )
)
def test_lists_of_numbers_round_trip(numbers: list) -> None:
    record = {"numbers": numbers}
    assert same(decode_line(encode_line(record)), record)


def test_plain_records_take_orjson_output() -> None:
    record = {"b": 1, "a": [1.5, None, "null"], "c": {"d": 2**63 - 1}}
    assert encode_line(record) == orjson.dumps(record) + b"\n"


def test_long_digit_strings_decode_exactly() -> None:
    # A string of many digits routes the line to the exact reader; the value must not change.
    record = {"s": "1" * 40, "i": 12345678901234567890123}
    assert decode_line(encode_line(record)) == record


@dataclass
class Point:
    x: int


@pytest.mark.parametrize(
    "value",
    [datetime.datetime(2026, 1, 1), {1, 2}, b"bytes", Point(1), {1: "int key"}, "\ud800", object()],
    ids=["datetime", "set", "bytes", "dataclass", "int-key", "surrogate", "object"],
)
def test_values_that_are_not_json_are_refused(value: object) -> None:
    with pytest.raises(NotJSON):
        encode_line({"episode_id": {"rollout_id": "r", "attempt": 0}, "v": value})
    # Also where the standard library path would be taken (a NaN elsewhere in the record).
    with pytest.raises(NotJSON):
        encode_line({"nan": math.nan, "v": [value]})


def test_decode_refuses_garbage() -> None:
    with pytest.raises(ValueError):
        decode_line(b'{"a": \n')


@pytest.mark.parametrize(
    "line",
    [
        b'{"a":123456789012345678901234567890}\n',
        b'{"a":[1,2,-99999999999999999999]}\n',
        b'{"a":[0.5,"x",[18446744073709551616]]}\n',
        b'[{"deep":[[1,[2,[3,100000000000000000000000]]]]}]\n',
        b'{"a":[1e300,123456789012345678901234567890]}\n',
        b"12345678901234567890123\n",
    ],
)
def test_integers_beyond_64_bits_written_by_any_writer_decode_exactly(line: bytes) -> None:
    """No manifest extra tells the reader a file is free of them: every line is screened (cheaply)."""
    import json

    assert decode_line(line) == json.loads(line)
    assert repr(decode_line(line)) == repr(json.loads(line))


def test_large_floats_without_long_digit_runs_keep_orjson_output() -> None:
    line = b'{"a":[1e300,-9.3e18],"b":1.5e19}\n'
    assert decode_line(line) == orjson.loads(line)


# -- the encoder's shortcuts: a line without "null" skips the NaN walk; the walk sums lists of numbers ----------


def _has_non_finite(value: object) -> bool:
    """The plain definition the codec's walk must agree with."""
    if type(value) is float:
        return not math.isfinite(value)
    if type(value) is dict:
        return any(_has_non_finite(v) for v in value.values())
    if type(value) in (list, tuple):
        return any(_has_non_finite(v) for v in value)
    return False


json_values_with_tuples = st.recursive(
    st.one_of(json_scalars, st.floats(min_value=-1e-3, max_value=1e-3)),
    lambda children: (
        st.lists(children, max_size=5)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=30,
)


@given(json_values_with_tuples)
def test_the_nan_walk_finds_exactly_the_non_finite_numbers(value: object) -> None:
    from nemo_gym_checkpoint_plugin._storage.codec import _needs_fallback

    assert _needs_fallback(value) is _has_non_finite(value)


@pytest.mark.parametrize(
    "record",
    [
        {"a": None, "b": math.nan},  # a None beside it: the line has null anyway
        {"m": [{"x": None}, {"y": [1, 2, math.inf]}]},  # a list that starts with an int
        {"m": [1, "x", -math.inf]},  # a list that is not all numbers
        {"t": (0.5, [None, math.nan])},
        {"n": [1e308, 1e308], "z": [math.nan]},  # a sum that overflows is looked at closer
        {"s": "null", "v": math.nan},
    ],
)
def test_a_non_finite_number_is_never_skipped(record: dict) -> None:
    from nemo_gym_checkpoint_plugin._storage.codec import encode_record

    line, exact = encode_record(record)
    assert exact and (b"NaN" in line or b"Infinity" in line)
    assert same(decode_line(line), json_roundtrip(record))


def json_roundtrip(value: object) -> object:
    """``value`` as JSON gives it back: tuples become lists."""
    if type(value) is dict:
        return {k: json_roundtrip(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return [json_roundtrip(v) for v in value]
    return value


# -- the decoder's screen: a run of 19 digits not after a "." may be an integer beyond 64 bits -------------------


@pytest.mark.parametrize(
    "line",
    [
        b'{"f":0.00030000000000000003,"a":123456789012345678901234}\n',  # a fraction's run first
        b'{"f":[0.0001230000052601099,0.0001230000052601099],"a":-99999999999999999999}\n',
        b"[0.0000000000000000000000000000000000000001,-12345678901234567890]\n",  # a 40-digit fraction
        b"[ 12345678901234567890123]\n",
    ],
)
def test_an_integer_beyond_64_bits_after_long_fractions_decodes_exactly(line: bytes) -> None:
    import json

    assert repr(decode_line(line)) == repr(json.loads(line))


@given(
    st.lists(st.floats(min_value=-1e-3, max_value=1e-3, allow_nan=False), max_size=20),
    st.integers(min_value=2**64, max_value=2**200) | st.integers(min_value=-(2**200), max_value=-(2**63) - 1),
    st.integers(min_value=0, max_value=20),
)
def test_an_integer_beyond_64_bits_among_small_floats_survives(floats: list, big: int, at: int) -> None:
    numbers = [*floats[:at], big, *floats[at:]]
    record = {"logprobs": numbers}
    back = decode_line(encode_line(record))
    assert same(back, record) and type(back["logprobs"][min(at, len(floats))]) is int


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("odd", [2**70, -(2**64), math.nan, -math.inf])
def test_a_record_decided_by_the_walk_or_past_its_budget_is_exact(dense: bool, odd: object) -> None:
    # Dense: thousands of small containers for its bytes, so the walk runs over its budget and the
    # byte search decides; sparse: long strings and number lists, decided by the walk alone.
    if dense:
        record = {"items": [{"a": i, "b": [i, -i]} for i in range(3000)] + [{"odd": odd}]}
    else:
        record = {"text": "x" * 200_000, "ids": list(range(2000)), "tail": [{"odd": odd}]}
    back = decode_line(encode_line(record))
    assert same(back, record)


def test_the_budgeted_walks_stop_undecided_past_their_budget() -> None:
    from nemo_gym_checkpoint_plugin._storage.codec import _holds_huge_number, _needs_fallback

    dense = [{"a": i} for i in range(100)] + [{"odd": math.nan}]
    assert _needs_fallback(dense, 10) is None and _needs_fallback(dense) is True
    assert _holds_huge_number([float(2**70)] + [[i] for i in range(100)], 10) is None
    assert _holds_huge_number({"ids": list(range(5000)), "text": "x" * 10}, 10) is False
