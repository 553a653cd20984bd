"""How much memory this process may still use: what a proof's plan (stream, load, or decline) is sized by."""

from __future__ import annotations

from pathlib import Path


def available_memory() -> int:
    """Memory this process may still use: MemAvailable, capped by what its memory cgroup (v1 or v2) has left.
    A cgroup counts the page cache of the files its processes read and wrote as used, though the kernel drops
    clean pages when the memory is needed: they count as free here, so that what a job may do does not depend on
    what the cache happens to hold (a push's just-downloaded shards)."""
    free = 8 * 2**30
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            free = int(line.split()[1]) * 1024
    try:
        groups = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return free
    for line in groups:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            folder = Path(f"/sys/fs/cgroup{path}")
            limit, usage, stat = folder / "memory.max", folder / "memory.current", folder / "memory.stat"
        elif "memory" in controllers.split(","):
            folder = Path(f"/sys/fs/cgroup/memory{path}")
            limit, usage, stat = (
                folder / "memory.limit_in_bytes",
                folder / "memory.usage_in_bytes",
                folder / "memory.stat",
            )
        else:
            continue
        try:
            cap = limit.read_text().strip()
            if cap != "max" and int(cap) < 2**60:
                free = min(free, int(cap) - int(usage.read_text()) + reclaimable_cache(stat.read_text()))
        except (OSError, ValueError):
            continue
    return max(free, 0)


def reclaimable_cache(stat: str) -> int:
    """Bytes of clean file cache a memory cgroup's `memory.stat` counts as used: the file pages (v2 `file`, v1
    `total_cache`), less shared memory (tmpfs: not reclaimable) and pages still dirty or being written back."""
    values = dict(line.split() for line in stat.splitlines() if len(line.split()) == 2)
    v2 = "file" in values
    get = (lambda k: int(values.get(k, 0))) if v2 else (lambda k: int(values.get(f"total_{k}", values.get(k, 0))))
    if v2:
        return max(get("file") - get("shmem") - get("file_dirty") - get("file_writeback"), 0)
    return max(get("cache") - get("shmem") - get("dirty") - get("writeback"), 0)
