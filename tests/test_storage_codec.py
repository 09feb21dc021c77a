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


@pytest.mark.parametrize("line", [
    b'{"a":123456789012345678901234567890}\n',
    b'{"a":[1,2,-99999999999999999999]}\n',
    b'{"a":[0.5,"x",[18446744073709551616]]}\n',
    b'[{"deep":[[1,[2,[3,100000000000000000000000]]]]}]\n',
    b'{"a":[1e300,123456789012345678901234567890]}\n',
    b'12345678901234567890123\n',
])
def test_integers_beyond_64_bits_written_by_any_writer_decode_exactly(line: bytes) -> None:
    """No manifest extra tells the reader a file is free of them: every line is screened (cheaply)."""
    import json

    assert decode_line(line) == json.loads(line)
    assert repr(decode_line(line)) == repr(json.loads(line))


def test_large_floats_without_long_digit_runs_keep_orjson_output() -> None:
    line = b'{"a":[1e300,-9.3e18],"b":1.5e19}\n'
    assert decode_line(line) == orjson.loads(line)
