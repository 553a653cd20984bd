"""A file's bytes given back to the disk where every reader is done with them: the length stays, the blocks go."""

from __future__ import annotations

import os

import pytest

from converter.io.holes import BLOCK, punch


def _can_punch(folder) -> bool:
    probe = folder / "probe"
    probe.write_bytes(bytes(4 * BLOCK))
    return punch(probe, 0, 2 * BLOCK) > 0


def test_a_punched_range_reads_as_zeros_and_takes_no_blocks(tmp_path):
    if not _can_punch(tmp_path):
        pytest.skip("this file system makes no holes (files then go whole)")
    path = tmp_path / "f"
    data = os.urandom(64 * BLOCK)
    path.write_bytes(data)
    os.sync()
    before = os.stat(path).st_blocks
    freed = punch(path, 10 * BLOCK + 100, 40 * BLOCK + 7)  # only the whole blocks inside go
    assert freed == 29 * BLOCK
    after = path.read_bytes()
    assert len(after) == len(data) and os.stat(path).st_blocks * 512 <= before * 512 - freed
    assert after[: 11 * BLOCK] == data[: 11 * BLOCK] and after[40 * BLOCK :] == data[40 * BLOCK :]
    assert after[11 * BLOCK : 40 * BLOCK] == bytes(29 * BLOCK)


def test_less_than_a_block_is_left_alone(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * (3 * BLOCK))
    assert punch(path, 100, BLOCK + 50) == 0 and path.read_bytes() == b"x" * (3 * BLOCK)
