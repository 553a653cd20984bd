"""Where a job fits: the disk, memory and time a merge or push needs on a machine, streamed or whole, from its
shape (converter.jobs.shape: headers only); what this machine has; the Hugging Face Jobs flavor that fits when
this machine does not.

The model is deliberately simple, and each number says where it comes from:

- Disk. A streamed push holds the base's window (WINDOW_SHARDS x the output shard size: bytes every reader is done
  with are given back as holes) plus its largest tensor (one that does not fit the window still arrives whole),
  SHARDS_ON_DISK x the output shard size, and the adapters (converter.jobs.streaming's bounds). Where
  the behaviour cannot be compared as the models stream, verification reads the finished folder: the whole base
  download plus the whole output. A local or mounted base is read in place (no base bytes on disk). A `merge` writes
  the whole output, and a Hub base is downloaded whole into the HF cache (assumed to be on the same disk).
- Memory. The merge's own peak is nearly flat (PROCESS_MEMORY); the streamed comparison holds its two forwards'
  `streamed_working_set`, and runs only where that is available (else verification reads the finished folder,
  offloading to disk what memory cannot hold).
- Time. Bytes over a link rate (an assumption: LINK_RATE here, JOBS_LINK_RATE next to the Hub, or --link-rate),
  and CPU seconds per GB of weights for the default verified merge, measured (VERIFIED_CPU_*), spread over at
  most PARALLEL cores. A streamed push takes the longest of its download, its upload and its computing, plus
  the last shard's upload; a whole one computes its verification after that; a merge downloads, then computes.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from converter.errors import DoesNotFit
from converter.hub.hf_jobs import Flavor, Hardware
from converter.io.units import human_bytes, parse_size
from converter.jobs.shape import JobShape, shape_of
from converter.jobs.streaming import SHARDS_ON_DISK, WINDOW_SHARDS

SMALLEST_SHARD = 64 * 2**20  # the smallest output shard a push takes to fit a small disk
# The CPU rates and the process's memory below are measured: docs/jobs.md ("What the estimate assumes") names the
# runs they come from. CPU of the default merge (merge, tensor proof, quick behaviour check) against the base's
# weights, the line through two runs:
VERIFIED_CPU_FIXED = 7.2  # seconds
VERIFIED_CPU_PER_GB = 10.1  # seconds per GB of base weights
MERGE_CPU_PER_GB = 3.4  # the merge alone (`--no-verify`)
PARALLEL = 1.2  # the cores those runs kept busy; more cores are not assumed to help
# The process of a verified push without its behaviour comparison (the libraries verification imports, the merge,
# the shard-by-shard tensor proof), and of the merge alone: below these a job is refused; above, memory only decides
# whether the comparison streams.
PROCESS_MEMORY = 896 * 2**20
MERGE_MEMORY = 256 * 2**20
# Assumptions, not measurements: a link to the Hub from a workstation, and from a Jobs machine next to it.
LINK_RATE = 50 * 10**6  # bytes/s each way; --link-rate or CONVERTER_LINK_RATE
JOBS_LINK_RATE = 200 * 10**6  # CONVERTER_JOBS_LINK_RATE
# A Jobs machine: its first minutes pull the image and install converter (assumed), the OS and the container keep
# some of its memory (assumed), and a job is given twice its estimate plus a margin before it is stopped.
JOB_START_SECONDS = 300.0
JOB_MEMORY_RESERVE = 2 * 10**9
TIMEOUT_FACTOR, TIMEOUT_MARGIN = 2.0, 900


@dataclass(frozen=True)
class Machine:
    """Where a job would run: free scratch `disk` (in `where`), `memory` it may use, `cores`, the `link` rate in
    bytes/s each way, and for a Jobs flavor its price and start-up time."""

    name: str
    disk: int
    memory: int
    cores: int
    link: float
    where: str = ""
    usd_per_hour: float | None = None
    start_seconds: float = 0.0


@dataclass(frozen=True)
class Estimate:
    """A job on a machine: `streamed` (the proofs run as the models stream) or whole, and why; the scratch `disk`
    and `memory` it needs; bytes it moves; its time; whether it `fits`, and if not, `short` says what is short."""

    machine: Machine
    verb: str
    streamed: bool
    why: str
    disk: int
    memory: int
    download: int
    upload: int
    cpu_seconds: float
    seconds: float
    fits: bool
    short: str | None = None
    shard: int = 0  # the output shard size it assumes (a push made to fit a small disk takes smaller ones)

    @property
    def usd(self) -> float | None:
        price = self.machine.usd_per_hour
        return None if price is None else price * self.seconds / 3600

    @property
    def timeout(self) -> int:
        """Seconds a Job of this estimate is given before the Hub stops it."""
        return int(TIMEOUT_FACTOR * self.seconds) + TIMEOUT_MARGIN

    def to_dict(self) -> dict:
        return asdict(self) | {"usd": self.usd}


def link_rate(given: str | None = None, *, jobs: bool = False) -> float:
    """Bytes/s: `given` (--link-rate, e.g. 50MB), else CONVERTER_LINK_RATE / CONVERTER_JOBS_LINK_RATE, else the
    assumed default."""
    text = given or os.environ.get("CONVERTER_JOBS_LINK_RATE" if jobs else "CONVERTER_LINK_RATE")
    return float(parse_size(text.removesuffix("/s"))) if text else float(JOBS_LINK_RATE if jobs else LINK_RATE)


def here(where: str | Path | None = None, *, link: float | None = None, max_disk: int | None = None) -> Machine:
    """This machine: the free disk where the job's scratch goes (`where`, default the temp folder; at most
    `max_disk`), the memory available now (reclaimable page cache counted free), the cores this process may use."""
    import tempfile

    from converter.io.memory import available_memory

    folder = Path(where) if where is not None else Path(tempfile.gettempdir())
    probe = next((p for p in (folder, *folder.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory = available_memory() + _resident()  # what this process holds already is the job's too
    return Machine("this machine", min(free, max_disk) if max_disk is not None else free, memory, cores,
                   link if link is not None else link_rate(), str(folder))  # fmt: skip


def _resident() -> int:
    """This process's resident memory (0 where /proc does not say)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def on_flavor(flavor: Flavor, link: float | None = None) -> Machine:
    """A Jobs flavor as a machine; a disk the Hub does not state is taken as the smallest it states (20 GB)."""
    disk = flavor.disk if flavor.disk is not None else min(f.disk for f in _stated())
    return Machine(flavor.name, disk, max(flavor.memory - JOB_MEMORY_RESERVE, 0), flavor.cpus,
                   link if link is not None else link_rate(jobs=True), "the job's disk", flavor.usd_per_hour,
                   JOB_START_SECONDS)  # fmt: skip


def _stated() -> list[Flavor]:
    from converter.hub.hf_jobs import FALLBACK_FLAVORS

    return [f for f in FALLBACK_FLAVORS if f.disk is not None]


def estimate(shape: JobShape, machine: Machine, verb: str = "push", *, whole: str | None = None) -> Estimate:
    """`shape` on `machine`. `whole`: a reason this job reads its output whole anyway (a push merged first). A
    streamed push that the disk alone cannot hold takes smaller output shards, halved down to SMALLEST_SHARD,
    where the user gave no --max-shard-size: what it holds on disk is a few of them."""
    est = _estimate(shape, machine, verb, whole)
    smaller = shape
    while (not est.fits and est.streamed and shape.max_shard_size is None and est.memory <= machine.memory
           and smaller.shard // 2 >= SMALLEST_SHARD):  # fmt: skip
        smaller = replace(smaller, max_shard_size=str(smaller.shard // 2))
        est = _estimate(smaller, machine, verb, whole)
    return est if est.fits else _estimate(shape, machine, verb, whole)


def _estimate(shape: JobShape, machine: Machine, verb: str, whole: str | None) -> Estimate:
    budget = shape.memory_budget or machine.memory
    streamed_memory = shape.behaviour
    why = whole or shape.cannot_stream
    if why is None and shape.verify and streamed_memory > budget:
        why = (f"its two forwards need about {human_bytes(streamed_memory)} of memory, {human_bytes(budget)} is "
               "available")  # fmt: skip
    streamed = why is None and verb == "push"
    if verb == "merge":
        why = "a merge writes its whole output"
    disk = _disk(shape, verb, streamed)
    hollow = shape.verify and 0 < streamed_memory <= budget  # else the comparison offloads what memory lacks
    memory = _process(shape) + (streamed_memory if hollow else 0)
    download = (shape.weights + shape.side if shape.hub else 0) + shape.adapters
    upload = shape.output if verb == "push" else 0
    cpu, seconds = _time(shape, machine, verb, streamed, download, upload)
    short = _short(shape, machine, verb, disk, streamed, why)
    return Estimate(machine, verb, streamed, why or "both proofs run as the models stream", disk, memory, download,
                    upload, cpu, seconds, short is None, short, shape.shard)  # fmt: skip


def _disk(shape: JobShape, verb: str, streamed: bool) -> int:
    if verb == "merge" or not streamed:
        return (shape.weights + shape.side if shape.hub else 0) + shape.output + shape.adapters
    window = WINDOW_SHARDS * shape.shard + shape.largest_tensor
    base = min(window, shape.weights) + shape.side if shape.hub else 0
    return base + min(SHARDS_ON_DISK * shape.shard, shape.output) + shape.adapters


def _time(shape: JobShape, machine: Machine, verb: str, streamed: bool, down: int, up: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) on `machine`."""
    gb = shape.weights / 1e9
    merge_cpu = MERGE_CPU_PER_GB * gb
    cpu = VERIFIED_CPU_FIXED + VERIFIED_CPU_PER_GB * gb if shape.verify else merge_cpu
    cores = min(machine.cores, PARALLEL)
    link = max(machine.link, 1.0)
    if verb == "merge":
        return cpu, machine.start_seconds + down / link + cpu / cores
    tail = min(shape.shard, shape.output) / link  # the last shard's upload, which nothing overlaps
    if streamed:
        return cpu, machine.start_seconds + max(down / link, up / link, cpu / cores) + tail
    verifying = (cpu - merge_cpu) / cores
    return cpu, machine.start_seconds + max(down / link, up / link, merge_cpu / cores) + verifying + tail


def _short(shape: JobShape, machine: Machine, verb: str, disk: int, streamed: bool, why: str | None) -> str | None:
    """What `machine` lacks for this job, as a clause; None when it fits."""
    where = f" in {machine.where}" if machine.where else ""
    if disk > machine.disk and verb == "merge":
        what = "the base's download and the whole output" if shape.hub else "the whole output"
        return f"it needs {human_bytes(disk)} of disk for {what}, {human_bytes(machine.disk)} is free{where}"
    if disk > machine.disk:
        how = "streamed" if streamed else f"read whole ({why})"
        return f"it needs {human_bytes(disk)} of scratch disk {how}, {human_bytes(machine.disk)} is free{where}"
    if machine.memory < _process(shape):
        return f"it needs {human_bytes(_process(shape))} of memory, {human_bytes(machine.memory)} is available"
    return None


def _process(shape: JobShape) -> int:
    """The process's own memory: the libraries verification imports, or the merge alone."""
    return PROCESS_MEMORY if shape.verify else MERGE_MEMORY


def on_jobs(shape: JobShape, hardware: Hardware, link: float | None = None) -> list[Estimate]:
    """The job on each CPU flavor, cheapest first, its base mounted (read in place, not downloaded to disk)."""
    mounted = replace(shape, hub=False)
    return [_mounted_transfer(estimate(mounted, on_flavor(f, link)), shape) for f in hardware.cpu]


def _mounted_transfer(est: Estimate, shape: JobShape) -> Estimate:
    """A mounted base is still read over the network, lazily, as the merge reads it: its bytes count in time."""
    if not shape.hub:
        return est
    down = est.download + shape.weights + shape.side
    _, seconds = _time(replace(shape, hub=True), est.machine, est.verb, est.streamed, down, est.upload)
    return replace(est, download=down, seconds=seconds)


def best_flavor(estimates: list[Estimate], name: str | None = None) -> Estimate | None:
    """The flavor asked for, or else the cheapest that fits (None: none fits)."""
    if name is not None:
        return next((e for e in estimates if e.machine.name == name), None)
    return next((e for e in estimates if e.fits), None)


def require_fit(shape: JobShape, machine: Machine, hardware: Hardware | None, verb: str = "push",
                whole: str | None = None) -> Estimate:  # fmt: skip
    """The estimate here, or DoesNotFit (one line: what is short, and the Jobs flavor that fits with its time and
    cost, `--on-jobs FLAVOR`) before anything is downloaded. `hardware`: the flavors to offer (None: none)."""
    est = estimate(shape, machine, verb, whole=whole)
    if est.fits:
        return est
    jobs = best_flavor(on_jobs(shape, hardware)) if hardware is not None and verb == "push" else None
    if jobs is not None:
        way = (f"on Hugging Face Jobs it fits {jobs.machine.name} (about {duration(jobs.seconds)}, "
               f"{money(jobs.usd)}): add --on-jobs {jobs.machine.name}")  # fmt: skip
    elif verb == "push":
        way = "no Hugging Face Jobs CPU flavor fits it either"
    else:
        way = "free some disk, point TMPDIR / --out at a larger one, or publish it streamed with `converter push`"
    raise DoesNotFit(
        f"{shape.base}: does not fit here: {est.short}; {way}",
        where=machine.where, disk=est.disk, free=machine.disk, memory=est.memory, available=machine.memory,
        flavor=jobs.machine.name if jobs else None, seconds=jobs.seconds if jobs else None,
        usd=jobs.usd if jobs else None,
    )  # fmt: skip


def duration(seconds: float) -> str:
    """'40 s', '12 min', '2.5 h'."""
    if seconds < 90:
        return f"{math.ceil(seconds)} s"
    if seconds < 90 * 60:
        return f"{math.ceil(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def money(usd: float | None) -> str:
    """'about $0.25', 'under $0.01' (an estimate's cost); 'no charge' on a machine that has no price."""
    if usd is None:
        return "no charge"
    return f"about ${usd:.2f}" if usd >= 0.005 else "under $0.01"


def table(estimates: list[Estimate]) -> str:
    """Needs next to what each machine has, one line per machine (what --dry-run prints)."""
    lines = []
    for e in estimates:
        m = e.machine
        cost = f", {money(e.usd)}" if m.usd_per_hour is not None else ""
        lines.append(
            f"{m.name}: {'fits' if e.fits else 'does not fit'} ({'streamed' if e.streamed else 'whole'}: {e.why}); "
            f"disk {human_bytes(e.disk)} of {human_bytes(m.disk)} free, memory {human_bytes(e.memory)} of "
            f"{human_bytes(m.memory)}, {m.cores} cores; about {duration(e.seconds)}{cost} (download "
            f"{human_bytes(e.download)}, upload {human_bytes(e.upload)} at {human_bytes(m.link)}/s, "
            f"{e.cpu_seconds:.0f} CPU s)"
        )
    return "\n".join(lines)


def check_here(recipe, verify: dict | None, token: str | None, workdir: str | Path | None = None, *,
               verb: str = "push", whole: str | None = None, max_disk: int | None = None,
               link: float | None = None, headers=None) -> Estimate:  # fmt: skip
    """Refuse now (DoesNotFit) a job this machine cannot hold: its shape from headers (`headers`: the base's,
    already read, converter.jobs.shape.BaseHeaders; else read into a temp folder of `workdir`), the estimate
    against this machine's free disk in `workdir` (at most `max_disk`) and its memory."""
    from converter.hub.hf_jobs import hardware
    from converter.io.scratch import temp_folder

    if headers is not None:
        shape = shape_of(recipe, verify, token, Path(), headers)
    else:
        with temp_folder("fit", workdir, log=lambda _line: None) as tmp:
            shape = shape_of(recipe, verify, token, tmp)
    machine = here(workdir, link=link, max_disk=max_disk)
    est = estimate(shape, machine, verb, whole=whole)
    if est.fits:
        return est
    return require_fit(shape, machine, hardware(token) if verb == "push" else None, verb, whole)
