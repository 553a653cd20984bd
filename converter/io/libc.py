"""Linux system calls the os module lacks (sync_file_range, fallocate's hole punching), from the C library."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from functools import cache


@cache
def _library():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


@cache
def function(name: str, *argtypes) -> Callable | None:
    """The C library's `name` with these argument types; None where there is no such function (not Linux)."""
    library = _library()
    found = getattr(library, name, None) if library is not None else None
    if found is not None:
        found.argtypes = list(argtypes)
    return found
