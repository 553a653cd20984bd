"""Give a file's bytes back to the disk without changing its length: a hole reads as zeros and takes no blocks.

Why: a Hub job downloads a base file of several GB and reads each tensor of it once or twice; once every reader is
done with a tensor, its bytes can go, so the disk holds what is still to be read, not the file.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from converter.io import libc

BLOCK = 4096
_PUNCH_HOLE, _KEEP_SIZE = 0x02, 0x01  # linux/falloc.h


def punch(path: Path, start: int, end: int) -> int:
    """Free the whole blocks inside bytes [start, end) of `path`; the bytes freed (0 where the file system or the
    platform cannot make holes: the file then keeps its blocks until it is deleted)."""
    first, last = -(-start // BLOCK) * BLOCK, end // BLOCK * BLOCK
    fallocate = libc.function("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    if fallocate is None or last <= first:
        return 0
    fd = os.open(path, os.O_WRONLY)
    try:
        if fallocate(fd, _PUNCH_HOLE | _KEEP_SIZE, first, last - first) != 0:
            return 0
    finally:
        os.close(fd)
    return last - first
