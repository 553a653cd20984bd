"""The torch-free merge path (converter.engine.npmath, npmerge) against torch and against exact arithmetic.

Conversions must give torch's bytes exactly, NaN/Inf/subnormals included. The merge math sums in float64 and
rounds once: it must equal PEFT's float64 merge rounded once (computed here in rationals: each patch's delta
exact, each addition rounded to float64, the result rounded once to the output dtype). The float32 torch path
agrees with it but for rare one-ulp ties (tests/engine/test_architectures.py holds both to PEFT's merge).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from converter.engine import npkernel, npmath, npmerge
from converter.engine.plan import OutputTensor, PlannedPatch
from converter.formats.patches import BiasDelta, FullDelta, LowRank, Ref, Replace, RowReplace, RowsOf
from converter.io.safetensors_file import TensorInfo

TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
BITS = {"F32": (np.uint32, 32), "F16": (np.uint16, 16), "BF16": (np.uint16, 16)}


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()]).numpy().copy()


def _tensor(bits: list[int], dtype: str) -> torch.Tensor:
    kind, _ = BITS[dtype]
    return torch.from_numpy(np.array(bits, dtype=kind).view(np.int32 if kind == np.uint32 else np.int16)).view(
        TORCH[dtype]
    )


@settings(max_examples=300, deadline=None)
@given(
    source=st.sampled_from(["F32", "F16", "BF16"]),
    target=st.sampled_from(["F32", "F16", "BF16"]),
    data=st.data(),
)
def test_conversions_match_torch_bit_for_bit(source, target, data):
    """Every bit pattern of the source dtype (Inf, subnormals, -0) converts as torch converts it; NaN stays NaN,
    with torch's bits where torch is consistent (from float32); from float16 torch itself writes a NaN as
    0x7FFFFFFF in its scalar loop and quietened in its vector loop, so only NaN-ness is compared there."""
    width = BITS[source][1]
    special = [0, 1, 2 ** (width - 1), 2 ** (width - 1) + 1, 2**width - 1]  # 0, smallest subnormal, -0, -sub, NaN
    bits = data.draw(
        st.lists(st.one_of(st.sampled_from(special), st.integers(0, 2**width - 1)), min_size=1, max_size=40)
    )
    t = _tensor(bits, source)
    expected = _bits(t.to(TORCH[target]))
    a = npmath.view(bytearray(_bits(t).tobytes()), source, (len(bits),))
    ours = npmath.narrow(npmath.widen(a, source), target) if target != "F32" else npmath.widen(a, source)
    nan = torch.isnan(t).numpy()
    if source != "F32":
        assert np.array_equal(ours.view(expected.dtype)[~nan], expected[~nan])
        assert np.isnan(npmath.widen(ours, target) if target == "BF16" else ours)[nan].all()
    else:
        assert np.array_equal(ours.view(expected.dtype), expected)


class _Source:
    """Adapter tensors held in memory, read as a safetensors file would give them."""

    def __init__(self, tensors: dict[str, tuple[np.ndarray, str]]):
        self.tensors = tensors
        self.file = self

    def shape(self, name):
        return self.tensors[name][0].shape

    def dtype(self, name):
        return self.tensors[name][1]

    def read_bytes(self, name):
        return bytearray(self.tensors[name][0].tobytes())

    def read(self, name):
        a, dtype = self.tensors[name]
        return torch.from_numpy(a.copy()).view(TORCH[dtype]).reshape(a.shape)


def _bf16_values(draw, shape, lo=-12, hi=4) -> np.ndarray:
    """bf16 numbers of bounded exponent: their rank-r products sum exactly in float64."""
    n = int(np.prod(shape))
    mant = draw(st.lists(st.integers(0, 127), min_size=n, max_size=n))
    exp = draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))
    sign = draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=n, max_size=n))
    return np.array([s * (1 + m / 128) * 2.0**e for s, m, e in zip(sign, mant, exp, strict=True)]).reshape(shape)


def _as_bf16(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _round_exact(q: Fraction, dtype: str) -> int:
    """The bits of rational `q` rounded to nearest-even in `dtype` (via round-to-odd, which composes)."""
    f = float(q)
    if Fraction(f) != q:  # round to odd at 53 bits: truncate towards zero, set the last bit
        if abs(Fraction(f)) > abs(q):
            f = float(np.nextafter(f, 0.0))
        u = np.array([f]).view(np.uint64) | np.uint64(1)
        f = float(u.view(np.float64)[0])
    if dtype == "F16":
        return int(np.array([f]).astype(np.float16).view(np.uint16)[0])
    f32 = np.array([f]).astype(np.float32)
    if float(f32[0]) != f and np.isfinite(f32[0]):  # round to odd at 24 bits
        u = f32.view(np.uint32).copy()
        if abs(float(f32[0])) > abs(f):
            u -= np.uint32(1)
        f32 = (u | np.uint32(1)).view(np.float32)
    if dtype == "F32":
        return int(np.array([f]).astype(np.float32).view(np.uint32)[0])
    return int(npmath.narrow(f32, "BF16")[0])


@st.composite
def _cases(draw):
    out, inp, r = draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(["BF16", "F16", "F32"]))
    transposed = draw(st.booleans())
    shape = (inp, out) if transposed else (out, inp)
    wbits = draw(st.lists(st.integers(0, 2 ** BITS[dtype][1] - 1), min_size=out * inp, max_size=out * inp))
    base = np.array(wbits, dtype=BITS[dtype][0]).reshape(shape)
    if not npmath.finite(base.view(npmath.NUMPY_FLOATS[dtype]) if dtype != "BF16" else base, dtype):
        base = np.where(
            (base & (0x7FFF if dtype != "F32" else 0x7FFFFFFF)) >= npmath._NAN_LIMIT[dtype], 0, base
        ).astype(BITS[dtype][0])
    up, down = _as_bf16(_bf16_values(draw, (out, r))), _as_bf16(_bf16_values(draw, (r, inp)))
    tensors = {"up": (up, "BF16"), "down": (down, "BF16")}
    scale = draw(st.sampled_from([1.0, 2.0, 0.5, 1.5, 0.25]))
    kind = draw(st.sampled_from(["lora", "lora_rows", "rows_of", "full", "replace_then_lora", "row_replace"]))
    lora = LowRank(Ref(_Source(tensors), "down"), Ref(_Source(tensors), "up"), scale)
    patches = [PlannedPatch(0, lora, None, transposed)]
    if kind == "lora_rows" and shape[0] > 1 and not transposed:
        patches = [PlannedPatch(0, RowsOf(lora, 0, 1), (0, 1), False)]
    if kind == "rows_of" and not transposed:
        patches = [PlannedPatch(0, RowsOf(lora, 0, out), None, False)]
    if kind == "full":
        tensors["diff"] = (_as_bf16(_bf16_values(draw, shape)), "BF16")
        tensors["bias"] = (_as_bf16(_bf16_values(draw, shape)), "BF16")
        patches += [PlannedPatch(0, FullDelta(Ref(_Source(tensors), "diff")), None, transposed)]
        patches += [PlannedPatch(0, BiasDelta(Ref(_Source(tensors), "bias"), 0.5), None, transposed)]
    if kind == "replace_then_lora":
        tensors["value"] = (_as_bf16(_bf16_values(draw, shape)), "BF16")
        patches.insert(0, PlannedPatch(0, Replace(Ref(_Source(tensors), "value")), None, transposed))
    if kind == "row_replace":
        tensors["rows"] = (_as_bf16(_bf16_values(draw, (1, shape[1]))), "BF16")
        patches.append(PlannedPatch(0, RowReplace(Ref(_Source(tensors), "rows"), (shape[0] - 1,)), None, transposed))
    nbytes = base.nbytes
    o = OutputTensor("w", TensorInfo("w", dtype, shape, 0, nbytes), dtype, shape, patches)
    return o, base, tensors


def _f64(q: Fraction) -> Fraction:
    return Fraction(float(q))


def _exact(o: OutputTensor, base: np.ndarray, tensors) -> tuple[np.ndarray, np.ndarray]:
    """The patches applied as PEFT's float64 merge does (exact deltas, float64 sums), each element rounded once.

    Returns the bits and a mask of the elements some patch touched: the others keep the base's bits (a -0.0
    included, which Fraction cannot hold), and a touched element that sums to zero may carry either sign."""
    dtype = o.dtype
    w = npmath.widen(base if dtype == "BF16" else base.view(npmath.NUMPY_FLOATS[dtype]), dtype).astype(np.float64)
    grid = [[Fraction(float(v)) for v in row] for row in w]
    touched = np.zeros(w.shape, dtype=bool)
    val = lambda name: npmath.widen(tensors[name][0], "BF16").astype(np.float64)  # noqa: E731
    for pp in o.patches:
        p = pp.patch
        if isinstance(p, Replace):
            grid = [[Fraction(float(v)) for v in row] for row in val("value")]
            touched[:] = True
        elif isinstance(p, RowReplace):
            grid[p.indices[0]] = [Fraction(float(v)) for v in val("rows")[0]]
            touched[p.indices[0]] = True
        elif isinstance(p, FullDelta | BiasDelta):
            d, f = val(p.sources[0]), Fraction(getattr(p, "scale", 1.0))
            grid = [
                [_f64(g + f * Fraction(float(x))) for g, x in zip(gr, dr, strict=True)]
                for gr, dr in zip(grid, d, strict=True)
            ]
            touched[:] = True
        else:
            lora = p.inner if isinstance(p, RowsOf) else p
            up, down = val("up"), val("down")
            if isinstance(p, RowsOf):
                up = up[p.start : p.end]
            prod = [[sum(Fraction(float(up[i, k])) * Fraction(float(down[k, j])) for k in range(up.shape[1]))
                     for j in range(down.shape[1])] for i in range(up.shape[0])]  # fmt: skip
            if pp.transposed:
                prod = [list(col) for col in zip(*prod, strict=True)]
            lo = pp.rows[0] if pp.rows else 0
            for i, row in enumerate(prod):
                grid[lo + i] = [_f64(g + Fraction(lora.scale) * x) for g, x in zip(grid[lo + i], row, strict=True)]
                touched[lo + i] = True
    rounded = np.array([[_round_exact(q, dtype) for q in row] for row in grid], dtype=BITS[dtype][0])
    base_bits = base.view(BITS[dtype][0]).reshape(rounded.shape)
    return np.where(touched, rounded, base_bits), touched


@contextlib.contextmanager
def _kernel(enabled: bool):
    """The merge with the compiled fused step (converter.engine.npkernel) or with numpy alone."""
    if enabled and npkernel.get() is None:
        pytest.skip("no C compiler here: the merge runs on numpy alone (tested by the other case)")
    saved = npkernel.get
    if not enabled:
        npkernel.get = lambda: None
    try:
        yield
    finally:
        npkernel.get = saved


@pytest.mark.parametrize("kernel", [True, False], ids=["fused", "numpy"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cases())
def test_numpy_merge_is_the_float64_merge_rounded_once(case, kernel):
    o, base, tensors = case
    dtype = o.dtype
    view = base if dtype == "BF16" else base.view(npmath.NUMPY_FLOATS[dtype])
    with _kernel(kernel):
        chunks = list(npmerge.merged_chunks(o, view))
    ours = np.concatenate([b.reshape(-1, *o.shape[1:]) for b in chunks]).view(BITS[dtype][0])
    exact, touched = _exact(o, base, tensors)
    sign = np.array(1 << (BITS[dtype][1] - 1), dtype=BITS[dtype][0])
    either_zero = touched & ((exact & ~sign) == 0) & ((ours & ~sign) == 0)
    assert np.array_equal(np.where(either_zero, 0, ours), np.where(either_zero, 0, exact)), (ours, exact)


def _hard_float64s(n: int, seed: int = 0) -> np.ndarray:
    """Values where one rounding differs from two: float32s on a bfloat16 tie (and a hair either side of one),
    exact ties, NaN, infinities, overflow past bfloat16's largest value, subnormals, zeros of both signs."""
    rng = np.random.default_rng(seed)
    f32 = (rng.standard_normal(n) * 10.0 ** rng.integers(-40, 39, n)).astype(np.float32)
    u = f32.view(np.uint32)
    u[: n // 2] = (u[: n // 2] & 0xFFFF0000) | 0x8000  # on a bfloat16 tie as float32
    x = f32.astype(np.float64)
    hair = rng.choice([-1.0, 0.0, 1.0], n) * np.abs(x) * 2.0**-40
    x[: n // 2] += hair[: n // 2]  # the float64 just off the tie (or on it)
    x[n // 2 : n // 2 + 8] = [np.nan, -np.nan, np.inf, -np.inf, 3.4e38, -3.4e38, 0.0, -0.0]
    x[n // 2 + 8 : n // 2 + 16] = np.float64(np.finfo(np.float32).tiny) * rng.random(8)  # subnormal float32
    return x


def test_fused_step_is_numpys_rounding_bit_for_bit():
    """The compiled add + round + finite check gives npmath's bytes for every input, the hard cases included."""
    kernel = npkernel.get()
    if kernel is None:
        pytest.skip("no C compiler here: the merge runs on numpy alone")
    x = _hard_float64s(1 << 16)
    ours = np.empty(x.size, np.uint16)
    assert not kernel.round_bf16(x, ours)  # NaN and infinities in the input: not finite
    assert np.array_equal(ours, npmath.narrow(x, "BF16"))
    finite = x[np.isfinite(x) & (np.abs(x) < 3e38)]
    out = np.empty(finite.size, np.uint16)
    assert kernel.round_bf16(finite, out) and np.array_equal(out, npmath.narrow(finite, "BF16"))
    base = npmath.narrow(np.random.default_rng(1).standard_normal(finite.size), "BF16")
    assert kernel.add_round_bf16(finite - npmath.widen(base, "BF16"), base, out)
    acc = finite - npmath.widen(base, "BF16")
    assert np.array_equal(out, npmath.narrow(acc + npmath.widen(base, "BF16"), "BF16"))


def test_blocks_cover_every_row_with_several_patches():
    """A tensor taller than one block: rows split across blocks still get their row-sliced patch exactly once."""
    rng = np.random.default_rng(0)
    out, inp, r = 700, 300, 4  # 436 rows per block: the slice (400, 600) straddles a block edge
    up = rng.standard_normal((out, r)).astype(np.float32)
    down = rng.standard_normal((r, inp)).astype(np.float32)
    tensors = {"up": (up, "F32"), "down": (down, "F32"), "part": (up[400:600], "F32")}
    src = _Source(tensors)
    lora = LowRank(Ref(src, "down"), Ref(src, "up"), 0.5)
    part = LowRank(Ref(src, "down"), Ref(src, "part"), 2.0)
    base = rng.standard_normal((out, inp)).astype(np.float32)
    o = OutputTensor("w", TensorInfo("w", "F32", (out, inp), 0, base.nbytes), "F32", (out, inp),
                     [PlannedPatch(0, lora, None, False), PlannedPatch(0, part, (400, 600), False)])  # fmt: skip
    exact = base.astype(np.float64) + 0.5 * (up.astype(np.float64) @ down)
    exact[400:600] += 2.0 * (up[400:600].astype(np.float64) @ down)
    exact = exact.astype(np.float32)
    assert np.array_equal(np.concatenate(list(npmerge.merged_chunks(o, base))), exact)
    with ThreadPoolExecutor(2) as pool:  # the blocks on two threads: the same bytes, in order
        assert np.array_equal(np.concatenate(list(npmerge.merged_chunks(o, base, pool))), exact)
    npmerge.CHUNK_BYTES, chunk = 436 * 300 * 4 * 2, npmerge.CHUNK_BYTES  # two blocks a chunk: chunk edges too
    try:
        assert np.array_equal(np.concatenate(list(npmerge.merged_chunks(o, base))), exact)
    finally:
        npmerge.CHUNK_BYTES = chunk


@pytest.mark.parametrize("kind", ["loha"])
def test_patches_numpy_does_not_cover_go_through_torch(kind):
    from converter.formats.patches import LoHa

    src = _Source({n: (np.ones((2, 2), np.float32), "F32") for n in ("a", "b", "c", "d")})
    loha = LoHa(*(Ref(src, n) for n in "abcd"), scale=1.0, shape=(2, 2))
    o = OutputTensor("w", TensorInfo("w", "F32", (2, 2), 0, 16), "F32", (2, 2), [PlannedPatch(0, loha, None, False)])
    assert not npmerge.supports(o)
