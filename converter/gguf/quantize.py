"""gguf's reference casts and quantizers (gguf.quants), computed with torch: the same bytes at a fraction of the cost.

Why: gguf's numpy Q8_0 makes a dozen model-sized temporaries on one thread, about 17 ns a value on a 2-core Xeon;
that made it the slowest stage of `merge --gguf`. Q8_0 is a few exact IEEE float32 operations per value (a block's
absolute maximum over 127, its reciprocal, a product, a rounding half away from zero), so torch, over slices that
stay in cache and on its threads, gives the same bits at about 3 ns a value (bench/RESULTS.md). BF16 is torch's
round-to-nearest-even cast, which is gguf's. A tensor whose Q8_0 scales or their reciprocals are not finite (NaN, an
infinity, a block of values below 1e-36), or a BF16 tensor holding NaN, goes to gguf's own code: what a cast of NaN
to int8 gives, or which NaN bits a cast keeps, is each library's own. tests/gguf compares the bytes
with gguf.quants.quantize's on ties, zero blocks, subnormals and odd shapes.
"""

from __future__ import annotations

import warnings

import gguf
import numpy as np

# a source tensor read from its file is a read-only array; torch only reads it here (said once, for this module only)
warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning, __name__)

Q8_0, BF16 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.BF16
SLICE = 2**18  # values per torch pass: 1 MiB of float32, which stays in a core's cache through the passes


def stored(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """The bytes (as gguf's arrays) of float32 `data` in `qtype`, exactly as gguf.quants.quantize makes them."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return data.astype(np.float32, copy=False)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if qtype not in (Q8_0, BF16) or data.ndim < 1 or data.shape[-1] % block or data.dtype != np.float32:
        return gguf.quants.quantize(data, qtype)  # F16 (numpy's cast), and gguf's own errors
    import torch

    flat = torch.from_numpy(np.ascontiguousarray(data).reshape(-1))
    out = np.empty(gguf.quants.quant_shape_to_byte_shape(data.shape, qtype), np.uint8)
    made = _bf16(flat, out) if qtype == BF16 else _q8_0(flat, out)
    return out if made and _first_row_agrees(data, out, qtype) else gguf.quants.quantize(data, qtype)


def _bf16(flat, out: np.ndarray) -> bool:
    import torch

    if torch.isnan(flat).any():
        return False
    torch.from_numpy(out.reshape(-1)).view(torch.bfloat16).copy_(flat)
    return True


def _q8_0(flat, out: np.ndarray) -> bool:
    """Q8_0 per 32 values: a float16 scale and 32 int8, SLICE values at a time."""
    import torch

    blocks = torch.from_numpy(out.reshape(-1, 34))
    for start in range(0, len(blocks), SLICE // 32):
        x = flat[start * 32 : (start + SLICE // 32) * 32].view(-1, 32)
        if not _q8_0_blocks(x, blocks[start : start + len(x)]):
            return False
    return True


def on_this_thread_alone() -> None:
    """Run this thread's torch work (the quantizer) on it alone, for a thread beside others that keep the cores busy
    (the merge's): torch's helper threads spin while they wait and took CPU from them. OpenMP's thread count is per
    thread; torch.set_num_threads would also set it for every thread that first uses torch afterwards (the
    verification's forwards then ran on one core)."""
    import contextlib
    import ctypes

    import torch

    torch.get_num_threads()  # torch's own set-up of this thread first (it would set the count again)
    with contextlib.suppress(AttributeError, OSError):  # (a torch without OpenMP: nothing to do)
        ctypes.CDLL(None).omp_set_num_threads(1)


def _first_row_agrees(data: np.ndarray, out: np.ndarray, qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether gguf's own quantization of the first row has the bytes torch made of it."""
    row = data.reshape(-1, data.shape[-1])[:1]
    want = gguf.quants.quantize(row, qtype).reshape(-1)
    return out.reshape(-1)[: want.size].tobytes() == want.tobytes()


def _q8_0_blocks(x, out) -> bool:
    """gguf's Q8_0.quantize_blocks on `x` (blocks, 32) into `out` (blocks, 34), operation for operation; False
    (nothing written) where a block's scale or its reciprocal is not finite."""
    import torch

    d = x.abs().amax(1, keepdim=True).div_(127)
    inverse = 1.0 / d
    if not (torch.isfinite(d).all() and torch.isfinite(inverse[d != 0]).all()):
        return False
    v = x * inverse.masked_fill_(d == 0, 0.0)
    # np_roundf: floor(|v|) + floor(2 * (|v| - floor(|v|))), with v's sign (every step exact in float32)
    a = v.abs()
    whole = a.floor()
    a.sub_(whole).mul_(2).floor_().add_(whole).copysign_(v)
    out[:, :2] = d.half().view(torch.uint8)
    out[:, 2:] = a.to(torch.int8).view(torch.uint8)
    return True
