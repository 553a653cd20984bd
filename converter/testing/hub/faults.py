"""Faults on demand (5xx, 429 with Retry-After, dropped connections, slowness) and the log of what was served,
so retry and resume paths can be tested without a network."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass


@dataclass
class Fault:
    """A fault served to the next ``times`` requests whose method and path (no query) match; ``hits`` counts them."""

    method: str | None
    path_regex: re.Pattern[str]
    status: int | None = None
    times: int = 1
    retry_after: float | None = None
    drop_connection: bool = False
    delay: float = 0.0
    hits: int = 0
    after: int = 0  # matching requests let through untouched before the fault starts
    passed: int = 0

    def matches(self, method: str, path: str) -> bool:
        return (
            self.hits < self.times
            and (self.method is None or self.method.upper() == method)
            and self.path_regex.search(path) is not None
        )


@dataclass(frozen=True)
class Seen:
    """One request as served (never its headers beyond Range: tokens stay out of logs)."""

    method: str
    path: str
    query: str
    status: int
    range: str | None
    authenticated: bool
    fault: bool


def retry_after(seconds: float) -> str:
    """The Retry-After value: an integer when it is one (the 2.4 client only parses integers)."""
    return str(int(seconds)) if float(seconds).is_integer() else str(seconds)


class FaultsMixin:
    """The server's fault injection and request log (part of HubServer)."""

    _lock: threading.RLock
    _faults: list[Fault]
    requests: list[tuple[str, str]]
    seen: list[Seen]

    def inject(
        self,
        method: str | None,
        path_regex: str,
        status: int | None = None,
        times: int = 1,
        retry_after: float | None = None,
        drop_connection: bool = False,
        delay: float = 0.0,
        after: int = 0,
    ) -> Fault:
        """Make the next ``times`` matching requests fail: ``status`` (+ ``Retry-After``), a connection dropped
        half-way through the response body (or before any byte when there is no body), and/or a ``delay``; the
        first ``after`` matching requests pass untouched (e.g. a file's header reads before its download).

        ``path_regex`` is searched in the raw request path without query string (revision ``refs/pr/1`` appears as
        ``refs%2Fpr%2F1``). Note the 2.4 client only parses integer ``Retry-After`` values.
        """
        if status is None and not drop_connection and not delay:
            raise ValueError("a fault needs a status, drop_connection or a delay")
        fault = Fault(
            method.upper() if method else None,
            re.compile(path_regex),
            status,
            times,
            retry_after,
            drop_connection,
            delay,
            after=after,
        )
        with self._lock:
            self._faults.append(fault)
        return fault

    def reset_log(self) -> None:
        """Forget ``requests`` and ``seen`` (e.g. between the two runs of a caching test)."""
        self.requests.clear()
        self.seen.clear()

    def clear_faults(self) -> None:
        """Drop faults not yet consumed, so one test's leftovers cannot hit the next."""
        with self._lock:
            self._faults.clear()

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, path):
                    if fault.passed < fault.after:
                        fault.passed += 1
                        continue
                    fault.hits += 1
                    return fault
        return None
