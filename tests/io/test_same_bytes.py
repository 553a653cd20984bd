"""same_bytes against the plain oracle, `bytes(x) == bytes(y)`: any length (a tail shorter than a word included),
any one byte changed, and the values that compare equal but are not the same bits."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from converter.io.same_bytes import same_bytes


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=0, max_size=67), flip=st.integers(min_value=0))
def test_agrees_with_comparing_bytes(data, flip):
    x = np.frombuffer(data, np.uint8).copy()
    assert same_bytes(x, x.copy())
    if x.size:
        y = x.copy()
        y[flip % y.size] ^= 1 + flip % 255
        assert same_bytes(x, y) is (x.tobytes() == y.tobytes()) is False
    if x.size % 2 == 0:
        assert same_bytes(x.view(np.float16), x.view(np.uint16))  # only the bytes count, not their dtype
    assert not same_bytes(x, np.append(x, 0))


def test_bits_not_values():
    nan = np.array([np.nan, 1.0], np.float32)
    assert same_bytes(nan, nan.copy()) and not np.array_equal(nan, nan)
    zeros = np.array([0.0, -0.0], np.float64)
    assert not same_bytes(zeros, np.zeros(2)) and np.array_equal(zeros, np.zeros(2))


def test_non_contiguous_arrays_compare_as_their_elements():
    grid = np.arange(48, dtype=np.float32).reshape(6, 8)
    assert same_bytes(grid[:, ::2], np.ascontiguousarray(grid[:, ::2]))
    assert not same_bytes(grid[:, ::2], grid[:, 1::2])
