"""Temp folders that say whose they are, so the next run removes what an interrupted one left behind.

A run killed with `kill -9` (OOM, a timeout, a Space restart) cannot clean up after itself. Every temp location
we create therefore carries its owner in its own name: `converter-<kind>.<pid>-<start>-<made>@<host>`, where
`<start>` is the process's start time from /proc (so a reused pid is told apart) and `<made>` when the folder was
made (staging beside an output is `.<out>.converter-out.…`). The name is the record because
`mkdir` makes it atomically: no instant exists where the folder is there and its owner unknown, and a folder half
removed still says whose it was. Whoever next creates a temp location in the same place removes those whose owner
is gone, and says so in one line; a live owner's (or another host's) are never touched.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from converter.errors import OutputError
from converter.io.units import human_bytes

_NAME = re.compile(
    r"^(?P<lead>(?:\..+\.)?)converter-(?P<kind>[a-z0-9-]+)\.(?P<pid>\d+)-(?P<start>\d+)-(?P<made>[0-9a-f]{20})"
    r"@(?P<host>[A-Za-z0-9.-]+)$"
)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
STOP_ENV = "CONVERTER_TEST_STOP"


@dataclass(frozen=True)
class Owner:
    """A process, told apart from a later one with the same pid by its start time (clock ticks since boot)."""

    start: int
    pid: int
    host: str

    def alive(self) -> bool:
        """False only when we know it is gone: another host's process cannot be checked, so it counts as alive."""
        if self.host != _host():
            return True
        if not _pid_exists(self.pid):
            return False
        stat = _stat(self.pid)
        if stat is None:  # no /proc, or one that hides other users' processes: the pid exists, assume it is ours
            return True
        state, start = stat
        return state not in "ZX" and start == self.start  # a zombie writes nothing more

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"


def _host() -> str:
    """The hostname as it can appear in a file name (and never with the '--' PEFT's offload rewrite trips on)."""
    return re.sub(r"-{2,}", "-", re.sub(r"[^A-Za-z0-9.]+", "-", socket.gethostname())).strip("-.") or "host"


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) from /proc/<pid>/stat; the command name may hold spaces and parentheses."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[19])


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def me() -> Owner:
    stat = _stat(os.getpid())
    return Owner(stat[1] if stat else 0, os.getpid(), _host())


@dataclass(frozen=True)
class Owned:
    """What a temp location's name says: the target it stages (`lead`, "" for plain temp folders), its owner, and
    when it was made (fixed-width hex of time_ns + 4 random digits: sorts in creation order)."""

    lead: str
    owner: Owner
    made: str


def owned_name(kind: str, lead: str = "") -> str:
    owner = me()
    made = f"{time.time_ns():016x}{uuid.uuid4().hex[:4]}"
    return f"{lead}converter-{kind}.{owner.pid}-{owner.start}-{made}@{owner.host}"


def owner_of(path: Path) -> Owned | None:
    """What the name of a temp location of ours says; None for anything else."""
    m = _NAME.match(path.name)
    if m is None:
        return None
    return Owned(m["lead"], Owner(int(m["start"]), int(m["pid"]), m["host"]), m["made"])


def size_of(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def remove(path: Path) -> None:
    """Remove a file or folder; errors ignored (a folder of another user's we cannot delete stays as it was)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with suppress(OSError):
            path.unlink()


def stale(parent: Path, lead: str | None = None, other_hosts: bool = False) -> list[Path]:
    """Our temp locations in `parent` (with that lead only, if given) whose owner is gone (`other_hosts`: or
    runs on another host)."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return []
    out = []
    for p in entries:
        found = owner_of(p)
        if found is None or (lead is not None and found.lead != lead):
            continue
        if not found.owner.alive() or (other_hosts and found.owner.host != _host()):
            out.append(p)
    return sorted(out)


def live(parent: Path, lead: str) -> list[tuple[Owned, Path]]:
    """Our temp locations in `parent` with this lead whose owner still runs (or cannot be checked), oldest first."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return []
    found = [(owner_of(p), p) for p in entries]
    return sorted(((f, p) for f, p in found if f and f.lead == lead and f.owner.alive()), key=lambda fp: fp[0].made)


def sweep(parent: Path, log: Callable[[str], None], lead: str | None = None, other_hosts: bool = False) -> int:
    """Remove what interrupted runs left in `parent`; one line says how much. Returns the bytes removed."""
    removed, runs = 0, set()
    for p in stale(parent, lead, other_hosts):
        size = size_of(p)
        remove(p)
        if not p.exists() and not p.is_symlink():
            removed += size
            runs.add(owner_of(p).owner)
    what = human_bytes(removed) if removed else "empty folders"
    if len(runs) == 1:
        log(f"removed {what} left by an interrupted run in {parent}")
    elif runs:
        log(f"removed {what} left by {len(runs)} interrupted runs in {parent}")
    return removed


def make_temp(kind: str, parent: str | Path | None = None, log: Callable[[str], None] = print) -> Path:
    """A new owned folder in `parent` (default: the temp dir), after removing stale ones there."""
    parent = Path(parent if parent is not None else tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    sweep(parent, log)
    path = parent / owned_name(kind)
    path.mkdir()
    return path


@contextmanager
def temp_folder(kind: str, parent: str | Path | None = None, log: Callable[[str], None] = print) -> Iterator[Path]:
    """`make_temp`, removed again at the end (on failure too); a full disk becomes a one-line error."""
    path = make_temp(kind, parent, log)
    try:
        yield path
    except OSError as e:
        remove(path)
        if e.errno in DISK_FULL:
            raise disk_full(path.parent, None, f"temp folder for {kind}; set TMPDIR to a larger disk") from None
        raise
    finally:
        remove(path)


def disk_full(where: Path, needs: int | None, hint: str = "free some space or write elsewhere") -> OutputError:
    """The one-line error for ENOSPC: where, what was needed, what is free now (after our partial files went)."""
    try:
        free = human_bytes(shutil.disk_usage(where).free)
    except OSError:
        free = "unknown"
    need = f"needs at least {human_bytes(needs)}, " if needs else ""
    return OutputError(f"no space left on {where}: {need}{free} free ({hint}, then run again)", path=where)


def stop_here(point: str) -> None:
    """Test hook: with CONVERTER_TEST_STOP=<point> the process stops itself (SIGSTOP) here, so a test can kill
    a real child at a known moment (`shard`: a shard was written; `staged`: an output is complete but not yet
    moved into place). Unset, this is one dictionary look-up."""
    if os.environ.get(STOP_ENV) == point:
        os.kill(os.getpid(), signal.SIGSTOP)


def startup_cleanup(workroot: str | Path | None, log: Callable[[str], None] = print) -> int:
    """For a server starting up: remove job folders (HF caches inside) that no running process owns, in the temp
    dir and in the server's own jobs' folder `workroot`. There, another host's folders go too: a Space restarted
    in a new container may have a new hostname, and its previous container's jobs are not running."""
    removed = sweep(Path(tempfile.gettempdir()), log)
    own = workroot is not None and Path(workroot).is_dir()
    if own and Path(workroot).resolve() != Path(tempfile.gettempdir()).resolve():
        removed += sweep(Path(workroot), log, other_hosts=True)
    return removed
