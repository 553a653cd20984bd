"""Bandwidth: one link each way shared by every transfer, so a benchmark sees the Hub behind one wire."""

from __future__ import annotations

import threading
import time


class Link:
    """One network link shared by every transfer in one direction, at `rate` bytes/s (None: unlimited).

    Each chunk reserves the next free slot on the link, so concurrent transfers share the rate like one wire."""

    def __init__(self, rate: float | None = None):
        self.rate = rate
        self._lock = threading.Lock()
        self._free = 0.0

    def take(self, n: int) -> None:
        """Block until `n` more bytes may pass."""
        if not self.rate or n <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free)
            self._free = start + n / self.rate
            until = self._free
        if until > now:
            time.sleep(until - now)
