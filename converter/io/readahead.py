"""The merge's reads on a thread of their own, a bounded number of bytes ahead of the math.

Without it the thread that drives the merge reads tensor i + 1 only once tensor i is merged, and the math
threads wait for every read: on a cold page cache each read waits for the disk. Reads are jobs taken in the
merge's order; each hands its pieces (a tensor's bytes, or a byte copy's chunks) to `pieces()`, which the merge
consumes in the same order. Memory stays bounded: pieces not yet taken never exceed `budget` bytes, except a
single piece larger than that, which is read only when nothing else is ahead.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator

Job = Callable[[Callable[[object], None]], None]  # job(put): reads, calls put(piece) for each piece, in order

_END = object()


class _Stopped(Exception):
    """The consumer went away: the reading thread stops at its next piece."""


class ReadAhead:
    """Runs `jobs` in order on one thread; the consumer takes each job's pieces with `pieces()` or `next()`."""

    def __init__(self, jobs: list[Job], budget: int, name: str = "converter-reader"):
        self._jobs = jobs
        self._budget = budget
        self._ahead = 0  # bytes put and not yet taken
        self._items: deque = deque()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for job in self._jobs:
                job(self._put)
                self._put(_END)
        except _Stopped:
            return
        except BaseException as e:  # noqa: BLE001 - raised in the consumer
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _put(self, piece: object) -> None:
        size = _size(piece)
        with self._cond:
            while not self._stopped and self._ahead and self._ahead + size > self._budget:
                self._cond.wait()
            if self._stopped:
                raise _Stopped
            self._items.append(piece)
            self._ahead += size
            self._cond.notify_all()

    def _take(self) -> object:
        with self._cond:
            while not self._items and self._error is None:
                self._cond.wait()
            if not self._items:
                raise self._error
            piece = self._items.popleft()
            self._ahead -= _size(piece)
            self._cond.notify_all()
            return piece

    def pieces(self) -> Iterator[object]:
        """The next job's pieces, in order (call once per job, in the jobs' order)."""
        while (piece := self._take()) is not _END:
            yield piece

    def next(self) -> object:
        """The next job's only piece (a job that puts exactly one)."""
        (piece,) = self.pieces()
        return piece

    def close(self, wait: bool = True) -> None:
        """Stop reading (idempotent). `wait=False` after a failure: the thread may be blocked in a read (a
        download still arriving) and ends at its next piece, or when its file is closed under it."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if wait:
            self._thread.join()


def _size(piece: object) -> int:
    """Bytes of a piece: a numpy array, a torch tensor, bytes or a memoryview."""
    if piece is _END:
        return 0
    nbytes = getattr(piece, "nbytes", None)
    return nbytes if nbytes is not None else len(piece)
