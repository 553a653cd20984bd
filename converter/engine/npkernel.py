"""One fused pass for the merge's last step: add the bf16 base, round the float64 sum once to bf16, check finite.

numpy needs a dozen passes for that step (widen, add, narrow to float32, tie check, five integer passes of
rounding, finite checks), each over the block, and that was most of a LoRA merge's CPU time (bench/RESULTS.md).
The same arithmetic as one C loop (npmath.narrow's rounding, bit for bit: tests/engine/test_npmerge.py compares them)
is compiled on first use with the system's C compiler and cached per machine; where there is no compiler, or
the build fails, `get()` answers None and the merge stays on numpy. CONVERTER_NO_KERNEL=1 turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* float64 -> bfloat16 bits, rounded once: float64 -> float32 in hardware, then a float32 that landed exactly on
   a bfloat16 tie without being the float64 is moved one float32 step towards it, then round-to-nearest-even on
   the bits; every NaN as 0xFFFF (torch's bits). The same steps as converter/engine/npmath.py's narrow(). */
static inline uint32_t round_bf16(double s) {
    float f = (float)s;
    uint32_t u;
    memcpy(&u, &f, 4);
    double d = s - (double)f; /* exact: what the float32 rounding dropped */
    uint64_t sb, db;
    memcpy(&sb, &s, 8);
    memcpy(&db, &d, 8);
    uint32_t tie = ((u & 0xFFFFu) == 0x8000u) & (d != 0.0);
    uint32_t away = (uint32_t)(((sb ^ db) >> 63) == 0); /* d has the sign of s: the float64 is further out */
    u += tie ? (away ? 1u : 0xFFFFFFFFu) : 0u;
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFFu : r;
}

/* out = bf16(acc + base): returns nonzero when an output is Inf or NaN. */
int64_t cv_add_round_bf16(const double *restrict acc, const uint16_t *restrict base, uint16_t *restrict out,
                          int64_t n) {
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)base[i] << 16;
        float w;
        memcpy(&w, &bits, 4);
        uint32_t r = round_bf16(acc[i] + (double)w);
        out[i] = (uint16_t)r;
        bad |= (r & 0x7FFFu) >= 0x7F80u;
    }
    return bad;
}

/* out = bf16(acc): returns nonzero when an output is Inf or NaN. */
int64_t cv_round_bf16(const double *restrict acc, uint16_t *restrict out, int64_t n) {
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t r = round_bf16(acc[i]);
        out[i] = (uint16_t)r;
        bad |= (r & 0x7FFFu) >= 0x7F80u;
    }
    return bad;
}
"""
# No -ffast-math, and no contraction into FMAs: the arithmetic must be exactly the IEEE steps written above.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]


class Kernel:
    """The compiled loops, called on C-contiguous numpy blocks."""

    def __init__(self, lib: ctypes.CDLL):
        p, n = ctypes.c_void_p, ctypes.c_int64
        self._add = lib.cv_add_round_bf16
        self._add.argtypes, self._add.restype = [p, p, p, n], n
        self._round = lib.cv_round_bf16
        self._round.argtypes, self._round.restype = [p, p, n], n

    def add_round_bf16(self, acc: np.ndarray, base: np.ndarray, out: np.ndarray) -> bool:
        """out = bf16(acc + base) (base as bf16 bits); False when an output is not finite."""
        assert acc.dtype == np.float64 and base.dtype == out.dtype == np.uint16 and acc.size == base.size == out.size
        assert acc.flags.c_contiguous and base.flags.c_contiguous and out.flags.c_contiguous
        return not self._add(_ptr(acc), _ptr(base), _ptr(out), acc.size)

    def round_bf16(self, acc: np.ndarray, out: np.ndarray) -> bool:
        """out = bf16(acc); False when an output is not finite."""
        assert acc.dtype == np.float64 and out.dtype == np.uint16 and acc.size == out.size
        assert acc.flags.c_contiguous and out.flags.c_contiguous
        return not self._round(_ptr(acc), _ptr(out), acc.size)


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _cache_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "converter"


def _cpu_key() -> str:
    """-march=native code is only for CPUs with the same features: the cached library's name carries them."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"


def build(folder: Path) -> Path | None:
    """Compile SOURCE into `folder` (once per source, flags and CPU); None without a working C compiler."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    key = hashlib.sha256("\0".join([SOURCE, *FLAGS, _cpu_key()]).encode()).hexdigest()[:16]
    target = folder / f"npkernel-{key}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src = Path(tmp) / "npkernel.c"
        src.write_text(SOURCE)
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *FLAGS, "-o", str(out), str(src)], capture_output=True, timeout=120)
        if proc.returncode != 0:
            return None
        os.replace(out, target)  # atomic: a concurrent run sees the old state or the finished library
    return target


@functools.cache
def get() -> Kernel | None:
    """The fused loops, or None (no compiler, a failed build, or CONVERTER_NO_KERNEL set): numpy does it then."""
    if os.environ.get("CONVERTER_NO_KERNEL"):
        return None
    try:
        path = build(_cache_folder())
        return Kernel(ctypes.CDLL(str(path))) if path else None
    except (OSError, subprocess.SubprocessError):
        return None
