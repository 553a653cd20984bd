"""Keep freed blocks in the process's heap while verification runs, and hand them back when it ends.

Why: the tensor proof and the behaviour check allocate and free the same few tens of megabytes over and over (a
row block's float32 values, PEFT's ΔW for it, a layer's float32 weights). glibc serves blocks that large from fresh
memory maps, or returns them to the system as soon as they are freed, so every block costs thousands of page faults:
system time that does nothing. Within `reused_heap()`, blocks below `MMAP_THRESHOLD` come from the heap and freed
ones are kept for the next block; on leaving, free memory goes back to the system as before (the threshold stays:
glibc has no way to restore its adaptive one). Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

from converter.io import libc

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 64 * 2**20  # above the proof's row blocks and PEFT's ΔW of one, and a layer's float32 weights
TRIM_THRESHOLD = 256 * 2**20  # free memory kept at the heap's top before it is returned
_DEFAULT_TRIM = 128 * 2**10  # glibc's default


@contextmanager
def reused_heap() -> Iterator[None]:
    """Large blocks reused from the heap inside; on exit, what is free is returned to the system (malloc_trim)."""
    mallopt = libc.function("mallopt", ctypes.c_int, ctypes.c_int)
    trim = libc.function("malloc_trim", ctypes.c_size_t)
    if mallopt is None or trim is None:
        yield
        return
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    try:
        yield
    finally:
        mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM)
        trim(0)
