"""converter.io.readahead: the merge's reads on their own thread, in order, bounded, errors raised where consumed."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from converter.io.readahead import ReadAhead


def test_pieces_come_in_the_jobs_order():
    jobs = [lambda put, i=i: [put(bytes([i]) * (i + 1)) for _ in range(i)] for i in range(5)]
    ahead = ReadAhead(jobs, budget=4)
    assert [list(ahead.pieces()) for _ in jobs] == [[bytes([i]) * (i + 1)] * i for i in range(5)]
    ahead.close()


def test_reads_stay_within_the_budget_but_one_large_piece_still_comes():
    """Pieces not yet taken never exceed the budget; a piece larger than the budget waits until nothing is
    ahead, then comes (a tensor larger than the budget is still read)."""
    high, seen = [0], []
    lock = threading.Lock()

    def job(size):
        def read(put):
            with lock:
                seen.append(size)
            put(np.zeros(size, np.uint8))

        return read

    sizes = [30, 30, 30, 100, 30, 30]
    ahead = ReadAhead([job(s) for s in sizes], budget=64)
    got = []
    for _ in sizes:
        threading.Event().wait(0.05)  # let the reader run ahead as far as it may
        high[0] = max(high[0], ahead._ahead)
        got.append(ahead.next().nbytes)
    ahead.close()
    assert got == sizes and high[0] <= 100 and high[0] > 0


def test_an_error_in_a_read_is_raised_where_that_piece_is_taken():
    def bad(put):
        raise OSError("disk gone")

    ahead = ReadAhead([lambda put: put(b"ok"), bad, lambda put: put(b"never")], budget=1 << 20)
    assert ahead.next() == b"ok"
    with pytest.raises(OSError, match="disk gone"):
        ahead.next()
    ahead.close()


def test_close_without_waiting_leaves_a_blocked_read_to_end_on_its_own():
    """After a failed merge the reader may be waiting for a download: close(wait=False) returns at once, and the
    thread stops at its next piece instead of reading on."""
    gate, reads = threading.Event(), []

    def slow(put):
        gate.wait(10)
        reads.append("slow")
        put(b"x")

    ahead = ReadAhead([slow, lambda put: reads.append("next") or put(b"y")], budget=1 << 20)
    ahead.close(wait=False)
    gate.set()
    ahead._thread.join(10)
    assert not ahead._thread.is_alive() and reads == ["slow"]
