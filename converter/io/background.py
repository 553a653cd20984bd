"""One background thread per job (hashing, writing) so I/O overlaps the float32 math on another core.

The queue is bounded, so a slow consumer throttles the producer and memory stays bounded. An error in the
thread is raised in the caller at its next `put` or at `close`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

_DONE = object()


class _Aborted(Exception):
    """Set as the worker's error by `abort`: the items still queued are skipped."""


class Worker:
    def __init__(self, fn: Callable[[object], None], maxsize: int = 2, name: str = "converter-worker"):
        self._fn = fn
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not _DONE:
            if self._error is None:
                try:
                    self._fn(item)
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    self._error = e

    @property
    def failed(self) -> bool:
        """Whether an item has raised (or the worker was aborted)."""
        return self._error is not None

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def put(self, item: object) -> None:
        self._raise()
        self._queue.put(item)

    def close(self) -> None:
        """Wait until everything queued is done; re-raise the first error."""
        self._queue.put(_DONE)
        self._thread.join()
        self._raise()

    def abort(self) -> None:
        """Stop after the item in hand, skipping what is queued and ignoring errors (the job failed already)."""
        if self._error is None:
            self._error = _Aborted()
        self._queue.put(_DONE)
        self._thread.join()
