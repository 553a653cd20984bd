"""The memory verification may use: inside a memory cgroup, the clean page cache of files just read or written
(a push's downloaded shards) is free memory, not used, so whether a proof runs does not depend on it."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from converter.io.memory import reclaimable_cache

V1 = "cache 600\nrss 10\ntotal_cache 500\ntotal_shmem 50\ntotal_dirty 30\ntotal_writeback 20\ntotal_rss 10\n"
V2 = "anon 10\nfile 500\nshmem 50\nfile_dirty 30\nfile_writeback 20\n"


def test_clean_file_cache_counts_as_reclaimable_in_both_cgroup_versions():
    assert reclaimable_cache(V1) == 400  # the hierarchy's totals, less tmpfs, dirty and writeback pages
    assert reclaimable_cache(V2) == 400
    assert reclaimable_cache("anon 10\nfile 5\nfile_dirty 9\n") == 0


def _own_memory_cgroup() -> Path | None:
    """A writable cgroup v1 memory folder of this process (a root test machine), else None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = Path(f"/sys/fs/cgroup/memory{path}")
            return folder if os.access(folder, os.W_OK) else None
    return None


@pytest.mark.skipif(_own_memory_cgroup() is None, reason="needs a writable cgroup v1 memory controller")
def test_inside_a_capped_cgroup_the_page_cache_of_a_written_file_is_available(tmp_path):
    group = _own_memory_cgroup() / f"converter-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(512 * 2**20))
        code = (
            "import os, sys\n"
            f"open('{group}/cgroup.procs', 'w').write(str(os.getpid()))\n"
            f"with open('{tmp_path}/blob', 'wb') as f:\n"
            "    for _ in range(300): f.write(os.urandom(2**20))\n"
            "    f.flush(); os.fsync(f.fileno())\n"
            f"usage = int(open('{group}/memory.usage_in_bytes').read())\n"
            "from converter.io.memory import available_memory\n"
            "print(usage, available_memory())\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
        usage, available = map(int, out.stdout.split())
        assert usage > 250 * 2**20  # the cache is charged to the group ...
        assert available > 400 * 2**20  # ... and still counts as memory a proof may use
    finally:
        group.rmdir()
