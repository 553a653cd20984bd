"""converter speaks only for itself: its own lines, nothing from the libraries under it (the command line while a
command runs, `make run` while it starts).

Why: a merge imports transformers, PEFT, bitsandbytes, diffusers, Ray ...; each has warnings, log lines and
progress bars of its own ("Failed to load CPU gemm_4bit_forward ...", "Loading weights", FutureWarnings) that look
like failures to a user and are not theirs. While a command runs, file descriptors 1 and 2 point at a temporary
file, so what is written there is held back: Python's stderr (warnings, logging, tqdm bars) and everything below
Python (C libraries, child processes). Python's stdout stays the terminal's, through a copy of the original
descriptor: converter's code prints its lines there (the `log` callables default to `print`); the libraries do
not. Errors go to a copy of the original stderr (`Console`). `-v` turns the capture off. After an unexpected
failure (a bug) the held-back tail is shown with the traceback.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import TextIO

from converter.io import progress

TAIL = 4000  # bytes of held-back output shown after a bug


class Console:
    """Where converter's own output goes: results and log lines to `out`, errors and progress bars to `err`."""

    def __init__(self, out: TextIO, err: TextIO, capture: int | None = None) -> None:
        self.out, self.err, self._capture = out, err, capture

    def line(self, msg: str) -> None:
        if progress.bar_file is not None:  # clear a bar being drawn, print, redraw it
            from tqdm import tqdm

            with tqdm.external_write_mode(file=progress.bar_file):
                print(msg, file=self.out, flush=True)
        else:
            print(msg, file=self.out, flush=True)

    def error(self, msg: str) -> None:
        print(msg, file=self.err, flush=True)

    def held_back(self) -> str:
        """The end of what the libraries wrote while the command ran (empty with -v)."""
        if self._capture is None:
            return ""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(ValueError, OSError):
                stream.flush()
        size = os.fstat(self._capture).st_size
        return os.pread(self._capture, TAIL, max(0, size - TAIL)).decode(errors="replace")


@contextlib.contextmanager
def session(verbose: bool = False) -> Iterator[Console]:
    """Run a command with third-party output held back (all of it shown when `verbose`); yields its Console."""
    with contextlib.ExitStack() as stack:
        out, err = _own_copy(sys.stdout, 1, stack), _own_copy(sys.stderr, 2, stack)
        capture = None
        if not verbose:
            capture = stack.enter_context(tempfile.TemporaryFile()).fileno()
            fcntl.fcntl(capture, fcntl.F_SETFL, fcntl.fcntl(capture, fcntl.F_GETFL) | os.O_APPEND)
        bar_before = progress.bar_file
        progress.bar_file = err if _is_terminal(err) else None
        stack.callback(setattr, progress, "bar_file", bar_before)
        if capture is not None:
            stack.enter_context(_redirected(capture, out))
        yield Console(out, err, capture)


def _own_copy(stream: TextIO, fd: int, stack: contextlib.ExitStack) -> TextIO:
    """A stream to `stream`'s destination that survives `fd` being redirected: a duplicate of the descriptor when
    `stream` writes to it (a terminal, a pipe), else `stream` itself (an in-memory capture, as under pytest)."""
    if not _writes_to(stream, fd):
        return stream
    stream.flush()
    copy = open(os.dup(fd), "w", encoding=stream.encoding, errors=stream.errors, buffering=1)  # noqa: SIM115
    stack.callback(copy.close)
    return copy


def _writes_to(stream: TextIO, fd: int) -> bool:
    try:
        return stream.fileno() == fd
    except (AttributeError, OSError, ValueError):
        return False


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, OSError, ValueError):
        return False


@contextlib.contextmanager
def _redirected(capture: int, out: TextIO) -> Iterator[None]:
    """fds 1 and 2 into `capture`, sys.stdout to `out` (the original stdout), and sys.stderr into `capture` too
    where it is not fd 2 (under pytest)."""
    streams = {"stdout": sys.stdout, "stderr": sys.stderr}
    for stream in streams.values():
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    try:
        for fd in saved:
            os.dup2(capture, fd)
        _HeldBack.target = capture
        sys.stdout = out
        if not _writes_to(sys.stderr, 2):
            sys.stderr = _HELD_BACK
        yield
    finally:
        for name, stream in streams.items():
            with contextlib.suppress(ValueError, OSError):
                getattr(sys, name).flush()
            setattr(sys, name, stream)
        _HeldBack.target = None
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)


class _HeldBack(io.TextIOBase):
    """Stands in for a sys.stdout/sys.stderr that is not fd 1/2 (pytest's capture). Never closed: a library that
    kept a reference to it (a logging handler made during the command) writes nowhere afterwards."""

    target: int | None = None

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if _HeldBack.target is not None:
            os.write(_HeldBack.target, s.encode(errors="replace"))
        return len(s)


_HELD_BACK = _HeldBack()
