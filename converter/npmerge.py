"""The torch-free merge of one output tensor: numpy, BLAS for B@A, float64 accumulation, one rounding.

A plain LoRA merge spends its time converting and adding, not multiplying; torch costs a second to import and
gives nothing here. The patches covered are the common ones (2-D LoRA in either layout, row slices of a fused
LoRA, full deltas, bias deltas, replacements, replaced rows); a tensor with any other patch (LoHa, LoKr, DoRA,
conv, Tucker, 4-bit) goes through converter.patches with torch, imported then.

The tensor is processed in blocks of rows small enough for the CPU cache: every patch here is row-local, so
applying all patches to one block, in order, is the same as applying each patch to the whole tensor. The sum is
taken in float64 (the rank-r products of float32 factors are exact there) and rounded once to the output dtype;
that is PEFT's float64 merge rounded once, which the float32 torch path matches but for rare one-ulp ties.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from converter import npmath
from converter.patches import BiasDelta, FullDelta, LowRank, Ref, Replace, RowReplace, RowsOf
from converter.plan import OutputTensor, PlannedPatch

BLOCK_ELEMENTS = 1 << 17  # 128 K elements: a float64 block and its product fit in L2 (measured fastest)


def _numpy_ref(ref: Ref) -> bool:
    file = getattr(ref.source, "file", None)  # SafetensorsSource: raw bytes we can view without torch
    return file is not None and hasattr(file, "read_bytes") and ref.source.dtype(ref.name) in npmath.NUMPY_FLOATS


def _linear(p: LowRank, ndim: int) -> bool:
    return p.mid is None and len(p.down.shape) == 2 and len(p.up.shape) == 2 and ndim == 2


def supports(o: OutputTensor) -> bool:
    """Whether every patch of `o` (and its dtypes) is covered here."""
    if o.source.dtype not in npmath.NUMPY_FLOATS or o.dtype not in npmath.NUMPY_FLOATS:
        return False
    for pp in o.patches:
        p = pp.patch
        if isinstance(p, LowRank):
            ok = _linear(p, len(o.shape)) and _numpy_ref(p.down) and _numpy_ref(p.up)
        elif isinstance(p, RowsOf):
            inner = p.inner
            ok = isinstance(inner, LowRank) and _linear(inner, len(o.shape))
            ok = ok and _numpy_ref(inner.down) and _numpy_ref(inner.up)
        elif isinstance(p, FullDelta):
            ok = _numpy_ref(p.diff)
        elif isinstance(p, BiasDelta):
            ok = _numpy_ref(p.delta)
        elif isinstance(p, Replace):
            ok = _numpy_ref(p.value)
        elif isinstance(p, RowReplace):
            ok = _numpy_ref(p.rows)
        else:
            ok = False
        if not ok:
            return False
    return True


def load(ref: Ref) -> np.ndarray:
    """An adapter tensor as float32 values (exactly what torch's Ref.load gives)."""
    dtype = ref.source.dtype(ref.name)
    return npmath.widen(npmath.view(ref.source.file.read_bytes(ref.name), dtype, ref.shape), dtype)


class _Delta:
    """One patch, prepared: adds its contribution to rows [i, j) of the running float64 tensor."""

    def __init__(self, pp: PlannedPatch, shape: tuple[int, ...]):
        self.lo, self.hi = pp.rows if pp.rows is not None else (0, shape[0] if shape else 1)
        region = (self.hi - self.lo, *shape[1:])
        p = pp.patch
        self.left = self.right = self.values = self.rows = None
        if isinstance(p, LowRank | RowsOf):
            lora = p.inner if isinstance(p, RowsOf) else p
            up, down = load(lora.up).astype(np.float64), load(lora.down).astype(np.float64)
            scale = lora.scale * lora.weight  # the factor torch's addmm takes as alpha
            if isinstance(p, RowsOf):
                self.left, self.right = up[p.start : p.end] * scale, down
            elif pp.transposed != p.flip:  # stored (in, out): rows of W are columns of B@A
                self.left, self.right = np.ascontiguousarray(down.T), np.ascontiguousarray((up * scale).T)
            else:
                self.left, self.right = up * scale, down
        elif isinstance(p, FullDelta):
            self.values, self.factor = load(p.diff).reshape(region), p.weight
        elif isinstance(p, BiasDelta):
            self.values, self.factor = load(p.delta).reshape(region), p.scale * p.weight
        elif isinstance(p, RowReplace):
            self.rows = (np.asarray(p.indices, dtype=np.int64), load(p.rows))
        else:
            raise AssertionError(f"no numpy form for {type(p).__name__}")

    def covers(self, i: int, j: int) -> bool:
        return self.lo <= i and j <= self.hi and self.rows is None

    def add(self, acc: np.ndarray, i: int, j: int, tmp: np.ndarray, first: bool = False) -> None:
        """acc[rows] += this patch's rows of ΔW; `first`: acc holds nothing yet (a product goes straight in)."""
        lo, hi = max(i, self.lo), min(j, self.hi)
        if lo >= hi:
            return
        target = acc[lo - i : hi - i]
        a, b = lo - self.lo, hi - self.lo
        if self.rows is not None:
            index, rows = self.rows
            keep = (index >= lo) & (index < hi)
            target[index[keep] - lo] = rows[keep]
        elif self.left is not None:
            if first:
                np.matmul(self.left[a:b], self.right, out=target)
            else:
                product = tmp.reshape(-1)[: target.size].reshape(target.shape)
                np.matmul(self.left[a:b], self.right, out=product)
                target += product
        else:
            values = self.values[a:b]
            if self.factor == 1.0:
                target += values
            else:
                target += values * self.factor


def merged_blocks(o: OutputTensor, base: np.ndarray) -> Iterator[np.ndarray]:
    """Output tensor `o` in row blocks (each a fresh array in o.dtype's numpy form), from `base` (npmath.view of
    the base tensor's bytes). Patches apply in order; a replacement restarts from its value."""
    start, src, src_dtype = 0, base, o.source.dtype
    for k, pp in enumerate(o.patches):
        if isinstance(pp.patch, Replace):
            start, src_dtype = k + 1, pp.patch.value.source.dtype(pp.patch.value.name)
            src = npmath.view(pp.patch.value.source.file.read_bytes(pp.patch.value.name), src_dtype, o.shape)
    shape = o.shape or (1,)
    src = src.reshape(shape)
    deltas = [_Delta(pp, shape) for pp in o.patches[start:]]
    row = max(1, int(np.prod(shape[1:], dtype=np.int64)))
    step = max(1, BLOCK_ELEMENTS // row)
    buf32 = np.empty(min(step, shape[0]) * row, np.float32)
    buf64 = np.empty(min(step, shape[0]) * row, np.float64) if deltas else None
    tmp = np.empty_like(buf64) if deltas else None
    for i in range(0, shape[0], step):
        j = min(shape[0], i + step)
        block_shape = (j - i, *shape[1:])
        w = npmath.widen(src[i:j], src_dtype, out=buf32[: (j - i) * row].reshape(block_shape))
        if not deltas:
            yield npmath.narrow(w, o.dtype) if o.dtype != src_dtype else src[i:j].copy()
            continue
        acc = buf64[: (j - i) * row].reshape(block_shape)
        first = deltas[0].covers(i, j) and deltas[0].left is not None
        if first:  # the common case, one LoRA: the product goes straight into acc, then the base is added
            deltas[0].add(acc, i, j, tmp, first=True)
            acc += w
        else:
            np.copyto(acc, w)
        for d in deltas[1 if first else 0 :]:
            d.add(acc, i, j, tmp)
        yield npmath.narrow(acc, o.dtype)
