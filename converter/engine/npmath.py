"""Float conversions in numpy for the torch-free merge: safetensors bytes <-> float64, rounded once.

bfloat16 has no numpy dtype; its bits are the top half of a float32, so widening is a shift and narrowing is
round-to-nearest-even on the bits. Narrowing from float64 rounds once: float64 -> float32 is exact rounding in
hardware, and the only case where rounding that float32 again to bfloat16 differs from rounding the float64
directly is a float32 that lands exactly on a bfloat16 tie (low 16 bits 0x8000) without being equal to the
float64; those few elements are nudged one float32 step towards the float64 first (docs/ARCHITECTURE.md,
"Torch-free merge"). NaN bits follow torch's conversions so every output byte matches the torch path.
"""

from __future__ import annotations

import numpy as np

# safetensors dtypes this module converts; anything else goes through torch.
NUMPY_FLOATS = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_NAN_LIMIT = {"BF16": 0x7F80, "F16": 0x7C00, "F32": 0x7F800000}  # |bits| >= limit: inf or NaN


def view(buf, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor in `buf` (bytes-like) as a numpy array; bfloat16 as its uint16 bits."""
    return np.frombuffer(buf, dtype=NUMPY_FLOATS[dtype]).reshape(shape)


def widen(a: np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """`a` (as `view` gives it) as float32 values, exact; into `out` (float32) when given."""
    if dtype == "BF16":
        bits = np.left_shift(a, 16, dtype=np.uint32, out=None if out is None else out.view(np.uint32))
        return bits.view(np.float32)
    if out is None:
        return a.astype(np.float32)
    np.copyto(out, a)
    return out


def _bf16_bits(u: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even of float32 bits `u` (uint32) to bfloat16 bits, into `out` (uint16); NaN not handled."""
    t = np.right_shift(u, 16)
    np.bitwise_and(t, 1, out=t)
    np.add(t, u, out=t)
    np.add(t, 0x7FFF, out=t)
    return np.right_shift(t, 16, out=out, casting="unsafe")


def narrow(x: np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """float64 or float32 values rounded once to `dtype` (bfloat16 as uint16 bits), with torch's NaN bits; into
    `out` (of x's shape) when given."""
    target = NUMPY_FLOATS[dtype]
    if dtype != "BF16":
        if out is None:
            out = x.astype(target)
        else:
            np.copyto(out, x, casting="same_kind")
        if dtype == "F16" and x.dtype == np.float32 and not finite(out, dtype):
            nan = np.isnan(x)
            u = x.view(np.uint32)[nan]  # torch: sign, quiet bit, the payload's top ten bits (numpy keeps it nonzero)
            out.view(np.uint16)[nan] = ((u >> 16) & 0x8000) | 0x7E00 | ((u & 0x7FFFFF) >> 13)
        return out
    f = x.astype(np.float32) if x.dtype == np.float64 else x
    u = f.view(np.uint32)
    if x.dtype == np.float64:
        ties = np.flatnonzero(np.bitwise_and(u, 0xFFFF) == 0x8000)
        if ties.size:  # a float32 exactly halfway between two bfloat16 values: was the float64 above or below?
            u = u.copy()
            flat, exact = u.reshape(-1), x.reshape(-1)[ties]
            away = np.abs(exact) > np.abs(f.reshape(-1)[ties])
            inexact = exact != f.reshape(-1)[ties]
            flat[ties] += np.where(inexact, np.where(away, 1, -1), 0).astype(np.uint32)
    out = _bf16_bits(u, np.empty(x.shape, np.uint16) if out is None else out)
    if not finite(f, "F32"):  # the bit rounding above wraps NaN bits into anything: fix them from the input
        out[np.isnan(x)] = 0xFFFF  # torch's float32 -> bfloat16 writes every NaN as 0xFFFF
    return out


def finite(a: np.ndarray, dtype: str) -> bool:
    """No NaN/Inf in `a` (as `view` gives it), from the bits: one masked max."""
    if a.size == 0:
        return True
    bits = a.view({2: np.uint16, 4: np.uint32}[a.itemsize])
    mask = 0x7FFF if a.itemsize == 2 else 0x7FFFFFFF
    return int(np.bitwise_and(bits, mask).max()) < _NAN_LIMIT[dtype]
