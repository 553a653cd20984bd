"""The torch-free merge of one output tensor: numpy, BLAS for B@A, float64 accumulation, one rounding.

A plain LoRA merge spends its time converting and adding, not multiplying; torch costs a second to import and
gives nothing here. The patches covered are the common ones (2-D LoRA in either layout, row slices of a fused
LoRA, full deltas, bias deltas, replacements, replaced rows); a tensor with any other patch (LoHa, LoKr, DoRA,
conv, Tucker, 4-bit) goes through converter.formats.patches with torch, imported then.

The tensor is processed in blocks of rows small enough for the CPU cache: every patch here is row-local, so
applying all patches to one block, in order, is the same as applying each patch to the whole tensor. The sum is
taken in float64 (the rank-r products of float32 factors are exact there) and rounded once to the output dtype;
that is PEFT's float64 merge rounded once, which the float32 torch path matches but for rare one-ulp ties.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from concurrent.futures import Executor
from functools import cache

import numpy as np

from converter.engine import npkernel, npmath
from converter.engine.plan import OutputTensor, PlannedPatch
from converter.errors import BadInputError
from converter.formats.patches import BiasDelta, FullDelta, LowRank, Ref, Replace, RowReplace, RowsOf

BLOCK_ELEMENTS = 1 << 15  # 32 K elements: a float64 block (256 KiB) and its product stay in L2
CHUNK_BYTES = 8 * 2**20  # output handed to the writer in chunks of this size


def viewable(source, name: str) -> bool:
    """Whether adapter tensor `name` of `source` can be read without torch: raw bytes of a safetensors file
    (SafetensorsSource) in a float dtype numpy handles."""
    file = getattr(source, "file", None)
    return file is not None and hasattr(file, "read_bytes") and source.dtype(name) in npmath.NUMPY_FLOATS


def raw(source, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A `viewable` tensor as stored (npmath.view: bfloat16 as its bits)."""
    return npmath.view(source.file.read_bytes(name), source.dtype(name), shape)


def _numpy_ref(ref: Ref) -> bool:
    return viewable(ref.source, ref.name)


def _linear(p: LowRank, ndim: int) -> bool:
    return p.mid is None and len(p.down.shape) == 2 and len(p.up.shape) == 2 and ndim == 2


def supports(o: OutputTensor) -> bool:
    """Whether every patch of `o` (and its dtypes) is covered here."""
    if o.source.dtype not in npmath.NUMPY_FLOATS or o.dtype not in npmath.NUMPY_FLOATS:
        return False
    for pp in o.patches:
        p = pp.patch
        if pp.expert is not None or getattr(p, "expert", None) is not None:
            return False  # one expert's slice of a fused MoE tensor: the torch path places it
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
    return npmath.widen(raw(ref.source, ref.name, ref.shape), ref.source.dtype(ref.name))


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


class _Buffers(threading.local):
    """Each thread's scratch blocks, reused (a fresh 256 KiB array per block would be an mmap and page faults)."""

    def get(self, kind: str, n: int, dtype) -> np.ndarray:
        buf = self.__dict__.get(kind)
        if buf is None or buf.size < n:
            buf = self.__dict__[kind] = np.empty(max(n, BLOCK_ELEMENTS), dtype)
        return buf[:n]


_BUFFERS = _Buffers()


class _Tensor:
    """One output tensor, prepared: its starting values and its deltas; `block(i)` merges rows [i, i + step)."""

    def __init__(self, o: OutputTensor, base: np.ndarray):
        start, src, self.src_dtype = 0, base, o.source.dtype
        for k, pp in enumerate(o.patches):
            if isinstance(pp.patch, Replace):
                value = pp.patch.value
                start, self.src_dtype = k + 1, value.source.dtype(value.name)
                src = raw(value.source, value.name, o.shape)
        self.o, self.shape = o, o.shape or (1,)
        self.src = src.reshape(self.shape)
        self.deltas = [_Delta(pp, self.shape) for pp in o.patches[start:]]
        self.row = max(1, int(np.prod(self.shape[1:], dtype=np.int64)))
        self.step = max(1, BLOCK_ELEMENTS // self.row)
        self.starts = range(0, self.shape[0], self.step)
        # The fused add + round + finite check (converter.engine.npkernel) for bf16 outputs, when it could be built.
        self.kernel = npkernel.get() if o.dtype == "BF16" else None

    def block(self, i: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [i, i + step) merged, into `out` (those rows of the output tensor) when given."""
        j = min(self.shape[0], i + self.step)
        n, block_shape = (j - i) * self.row, (j - i, *self.shape[1:])
        if not self.deltas:
            w = npmath.widen(self.src[i:j], self.src_dtype, out=_BUFFERS.get("w", n, np.float32).reshape(block_shape))
            if self.o.dtype != self.src_dtype:
                return npmath.narrow(w, self.o.dtype, out)
            if out is None:
                return self.src[i:j].copy()
            np.copyto(out, self.src[i:j])
            return out
        acc = _BUFFERS.get("acc", n, np.float64).reshape(block_shape)
        tmp = _BUFFERS.get("tmp", n, np.float64)
        kernel = self.kernel
        if out is None:
            out = np.empty(block_shape, npmath.NUMPY_FLOATS[self.o.dtype])
        first = self.deltas[0].covers(i, j) and self.deltas[0].left is not None
        if first:  # the common case, one LoRA: the product goes straight into acc, then the base is added
            self.deltas[0].add(acc, i, j, tmp, first=True)
            if kernel is not None and self.src_dtype == "BF16" and len(self.deltas) == 1:
                if not kernel.add_round_bf16(acc, self.src[i:j], out):  # base added, rounded, checked: one pass
                    self._not_finite()
                return out
            acc += self._widened(i, j, n, block_shape)
        else:
            np.copyto(acc, self._widened(i, j, n, block_shape))
        for d in self.deltas[1 if first else 0 :]:
            d.add(acc, i, j, tmp)
        if kernel is not None:
            finite = kernel.round_bf16(acc, out)
        else:
            out = npmath.narrow(acc, self.o.dtype, out)
            finite = npmath.finite(out, self.o.dtype)
        if not finite:
            self._not_finite()
        return out

    def _widened(self, i: int, j: int, n: int, block_shape: tuple[int, ...]) -> np.ndarray:
        return npmath.widen(self.src[i:j], self.src_dtype, out=_BUFFERS.get("w", n, np.float32).reshape(block_shape))

    def _not_finite(self):
        raise BadInputError(
            f"merged tensor {self.o.name} has NaN/Inf values in {self.o.dtype} (the adapter's delta overflows "
            "this base; check its alpha/scale, or merge into a wider --dtype)",
            tensor=self.o.name,
        )


@cache
def one_blas_thread() -> None:
    """Ask numpy's OpenBLAS for one thread: each product is a (rows, r) @ (r, in) block, too small to split, and
    BLAS threads would spin next to our own math threads. The CLI sets OPENBLAS_NUM_THREADS before numpy loads;
    this covers callers that imported numpy already."""
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "openblas" in line.lower() and line.rstrip().endswith(".so")}
        for path in libs:
            lib = ctypes.CDLL(path)
            for name in (
                "scipy_openblas_set_num_threads64_",
                "scipy_openblas_set_num_threads",
                "openblas_set_num_threads",
            ):
                if hasattr(lib, name):
                    getattr(lib, name)(1)
    except OSError:  # not Linux, or no OpenBLAS: nothing to do
        pass


def merged_chunks(o: OutputTensor, base: np.ndarray, pool: Executor | None = None) -> Iterator[np.ndarray]:
    """Output tensor `o` in chunks of about CHUNK_BYTES, in order: each chunk's row blocks are merged straight
    into its rows, on `pool`'s threads when given. Chunks, not blocks, go to the writer (one queue hand-off per
    8 MiB, not per 64 KiB block), and never the whole tensor (its buffer would grow with the largest tensor)."""
    t = _Tensor(o, base)
    dtype = npmath.NUMPY_FLOATS[o.dtype]
    rows = max(1, CHUNK_BYTES // (t.row * np.dtype(dtype).itemsize) // t.step) * t.step
    workers = max(1, getattr(pool, "_max_workers", 1))
    for c in range(0, t.shape[0], rows):
        e = min(t.shape[0], c + rows)
        out = np.empty((e - c, *t.shape[1:]), dtype)
        starts = list(range(c, e, t.step))
        if pool is None or len(starts) == 1:
            _blocks(t, out, c, starts)
        else:  # one task per thread, each a run of consecutive blocks: fewer hand-offs and wake-ups
            share = -(-len(starts) // workers)
            tasks = [pool.submit(_blocks, t, out, c, starts[k : k + share]) for k in range(0, len(starts), share)]
            for f in tasks:
                f.result()
        yield out


def _blocks(t: _Tensor, out: np.ndarray, c: int, starts: list[int]) -> None:
    """Merge the blocks starting at rows `starts` into `out` (rows from `c` on)."""
    for i in starts:
        t.block(i, out[i - c : i - c + t.step])
