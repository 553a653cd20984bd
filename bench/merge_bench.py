"""Benchmark `converter merge` against PEFT's merge_and_unload and a plain folder copy.

Why: the project claims a streaming merge is much faster and much smaller in memory than loading the model with
transformers + PEFT. This script measures that on a synthetic Llama-shaped ~0.86 B model (bf16) with a rank-16
all-linear LoRA, checks that both merges give the same weights, and tries both under cgroup memory caps.

    python bench/merge_bench.py [--workdir DIR] [--small] [--repeat N] [--no-caps] [--no-record]

Each tool runs in its own subprocess; wall time is measured here, peak RSS and CPU time come from the kernel's
rusage of that one process (via GNU time). As root the page cache is dropped before every run, so each run reads
its input cold. Results are appended to bench/RESULTS.md (not for --small). Inputs are built once and cached.
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily: the parent process stays light while the tools run
    import torch

BENCH_DIR = Path(__file__).resolve().parent
TOOLS = {
    "converter": "(a) `converter merge`",
    "peft": "(b) PEFT `merge_and_unload`",
    "copy": "(c) `cp -r` base",
    "imports": "(d) interpreter start: `python -c 'import converter.cli, converter.engine.merging'`",
}
# The floor for (a): copying the base's bytes plus starting an interpreter with what (a) imports, (c) + (d).
# `converter merge` verifies its output by default (since the CLI has --no-verify): (a) is the merge alone, the
# comparison the targets are about; this extra run, once per benchmark, is what the default command costs.
VERIFY_RUN = "converter-verify"
# (e), with --baseline REF: `converter merge --no-verify` of another commit's tree, the same way as (a). The
# default is the last commit of the float32 torch path, before the numpy path replaced it.
BASELINE_RUN = "baseline"
BASELINE_REF = "0385150"
LABELS = {**TOOLS, VERIFY_RUN: "(a') `converter merge`, default: merge + verification"}
MiB = 2**20
CAPS_MIB = (512, 1024)
RUN_TIMEOUT_S = 3600
# Near its cap a process can thrash (code pages evicted and re-read) for a very long time instead of being killed.
CAP_TIMEOUT_S = 300
TARGET_SPEEDUP = 5.0  # the project's targets for the merge: converter vs PEFT
TARGET_FLOOR = 3.0  # converter within this factor of the floor (copy + interpreter start)
TARGET_CAP_MIB = 512  # converter must finish under this memory cap

# The PEFT way, exactly as a user would write it. Phase times go to stdout (the run's log) for the diagnosis.
PEFT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    t0 = time.perf_counter()
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    t1 = time.perf_counter()
    base, adapter, out = sys.argv[1:4]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    t2 = time.perf_counter()
    model = PeftModel.from_pretrained(model, adapter)
    t3 = time.perf_counter()
    model = model.merge_and_unload()
    t4 = time.perf_counter()
    model.save_pretrained(out)
    t5 = time.perf_counter()
    print(f"phases: import {t1-t0:.1f}s, load base {t2-t1:.1f}s, load adapter {t3-t2:.1f}s, "
          f"merge {t4-t3:.1f}s, save {t5-t4:.1f}s", flush=True)
    """
)


# Fallback launcher where GNU time is missing: same output format (maxrss of the one child, in KiB).
LAUNCHER = textwrap.dedent(
    """
    import resource, subprocess, sys
    rc = subprocess.call(sys.argv[2:])
    with open(sys.argv[1], "w") as f:
        u = resource.getrusage(resource.RUSAGE_CHILDREN)
        f.write(f"maxrss_kib={u.ru_maxrss}\\ncpu_s={u.ru_utime} {u.ru_stime}\\n")
        if rc < 0:
            f.write(f"Command terminated by signal {-rc}\\n")
    sys.exit(rc if rc >= 0 else 128 - rc)
    """
)


@dataclass(frozen=True)
class Shape:
    """Llama dimensions of the synthetic base model."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int

    @property
    def tag(self) -> str:
        return f"llama-h{self.hidden}-l{self.layers}-i{self.intermediate}-v{self.vocab}-a{self.heads}-kv{self.kv_heads}"


FULL = Shape(hidden=2048, layers=16, intermediate=5632, vocab=32000, heads=16, kv_heads=4)
SMALL = Shape(hidden=256, layers=4, intermediate=688, vocab=4096, heads=4, kv_heads=2)
LORA_RANK = 16
LORA_ALPHA = 32


@dataclass
class RunResult:
    """One measured subprocess."""

    name: str
    rc: int
    wall_s: float
    sync_s: float
    peak_rss_mib: float
    log: Path
    cpu_s: float = 0.0  # user + system CPU time of the tool: less sensitive to other load than wall time
    load1: float = 0.0  # 1-minute load average when the run started: how busy the machine was
    cap_mib: int | None = None
    cache: str = "cold"  # "cold": page cache dropped before the run; "warm": the base read into it first
    oom_kills: int = 0
    cgroup_peak_mib: float | None = None  # memory.max_usage_in_bytes: RSS plus charged page cache
    timed_out: bool = False
    major_faults: int | None = None  # pgmajfault in the group: pages re-read from disk (thrashing at the cap)

    @property
    def ok(self) -> bool:
        return self.rc == 0

    @property
    def status(self) -> str:
        if self.ok:
            return "finished (exit 0)"
        if self.timed_out:
            faults = f", {self.major_faults:,} major page faults" if self.major_faults is not None else ""
            return f"did not finish: stopped by the benchmark after {self.wall_s:.0f} s{faults}"
        if self.oom_kills or self.rc == -9:
            return f"killed (OOM, exit {self.rc})"
        return f"failed (exit {self.rc})"


@dataclass
class Comparison:
    """Converter's output vs PEFT's, tensor by tensor, plus both vs a float64 reference of the changed tensors."""

    names_converter: int = 0
    names_peft: int = 0
    only_converter: list[str] = field(default_factory=list)
    only_peft: list[str] = field(default_factory=list)
    compared: int = 0
    bit_identical: int = 0
    max_abs_diff: float = 0.0
    elements: int = 0
    elements_differing: int = 0
    changed_vs_base: int = 0  # tensors where the converter's output differs from the base
    ref_tensors: int = 0
    ref_elements: int = 0
    converter_off_ref: int = 0  # elements not equal to the correctly rounded float64 result
    peft_off_ref: int = 0
    numpy_path_identical: bool | None = None  # (a) vs the same merge with CONVERTER_NO_KERNEL=1, file bytes


# ---------------------------------------------------------------------------------------------------------- inputs


def build_inputs(shape: Shape, folder: Path, shard: str = "1GB") -> tuple[Path, Path]:
    """Create (once) a random-init bf16 Llama base (in shards of `shard`) and a non-zero rank-16 all-linear PEFT
    LoRA for it."""
    base_dir, adapter_dir, marker = folder / "base", folder / "adapter", folder / ".complete"
    tag = shape.tag if shard == "1GB" else f"{shape.tag}-s{shard}"
    if marker.is_file() and marker.read_text() == tag:
        return base_dir, adapter_dir
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    print(f"building inputs in {folder} (once; cached afterwards) ...", flush=True)
    t0 = time.perf_counter()
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(base_dir, max_shard_size=shard)
    lora = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(adapter_dir)
    del model
    marker.write_text(tag)
    print(f"  {params / 1e9:.3f} B parameters, built in {time.perf_counter() - t0:.0f} s", flush=True)
    return base_dir, adapter_dir


# ------------------------------------------------------------------------------------------------------- measuring


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache so the next run reads cold; False without the privilege."""
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def warm_up(folder: Path) -> None:
    """Read every file of `folder` once so the next run finds it in the page cache."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(64 * MiB):
                    pass


def measure(
    name: str,
    cmd: list[str],
    log: Path,
    cold: bool,
    cgroup: Path | None = None,
    timeout: float = RUN_TIMEOUT_S,
    warm: Path | None = None,
) -> RunResult:
    """Run `cmd` once; wall time until it exits, then the time a global `sync` takes, and its own peak RSS.

    Peak RSS comes from a tiny launcher (GNU time, else a bare Python) that forks the tool: Linux carries the
    high-water RSS of the process that execs into the child's ru_maxrss, so this (possibly large) process must not
    be the tool's direct parent.
    """
    if cold:
        drop_caches()
    if warm is not None:
        warm_up(warm)
    stat = log.with_suffix(".rusage")
    stat.unlink(missing_ok=True)
    if Path("/usr/bin/time").is_file():
        launcher = ["/usr/bin/time", "-f", "maxrss_kib=%M\ncpu_s=%U %S", "-o", str(stat)]
    else:
        launcher = [sys.executable, "-S", "-c", LAUNCHER, str(stat)]
    full = [*launcher, *cmd]
    if cgroup is not None:  # the shell joins the group, then becomes the launcher; the tool inherits the group
        full = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *full]
    load1 = os.getloadavg()[0]
    with open(log, "w") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        t0 = time.perf_counter()
        # Its own session: on a timeout or an interrupt the launcher and the tool are stopped together.
        proc = subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    subprocess.run(["sync"], check=False)
    sync_s = time.perf_counter() - t1
    maxrss_kib, cpu_s = 0, 0.0
    for line in stat.read_text().splitlines() if stat.is_file() else []:
        if line.startswith("maxrss_kib="):
            maxrss_kib = int(line.split("=", 1)[1])
        elif line.startswith("cpu_s="):
            cpu_s = sum(float(x) for x in line.split("=", 1)[1].split())
        elif line.startswith("Command terminated by signal"):
            rc = -int(line.split()[-1])  # the launcher exits 128+N; report the signal itself
    cache = "warm" if warm is not None else "cold" if cold else "warm"
    return RunResult(
        name, rc, wall, sync_s, maxrss_kib / 1024, log, cpu_s=cpu_s, load1=load1, timed_out=timed_out, cache=cache
    )


def memory_cgroup_root() -> Path | None:
    """This process's own cgroup v1 memory group: caps go in children of it, inside whatever limits it has."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            root = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if (root / "cgroup.procs").is_file() and os.access(root, os.W_OK):
                return root
    return None


def make_cgroup(root: Path, name: str, cap_mib: int) -> tuple[Path, bool]:
    """Create a capped group; the memsw (RAM+swap) limit is set to the same value when available: no swap escape."""
    group = root / name
    group.mkdir()
    try:
        limit = str(cap_mib * MiB)
        (group / "memory.limit_in_bytes").write_text(limit)  # first: memsw may never be below it
        memsw = group / "memory.memsw.limit_in_bytes"
        has_memsw = memsw.is_file()
        if has_memsw:
            memsw.write_text(limit)
    except OSError:
        group.rmdir()
        raise
    return group, has_memsw


def remove_cgroup(group: Path) -> None:
    """Reclaim what is still charged (page cache) and remove the group; retried because exit is asynchronous."""
    for _ in range(50):
        with contextlib.suppress(OSError):
            (group / "memory.force_empty").write_text("0")
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)
    print(f"warning: could not remove cgroup {group}", file=sys.stderr)


def run_capped(
    root: Path, jobs: list[tuple[str, int, list[str], Path]], logs: Path, cold: bool, timeout: float
) -> tuple[list[RunResult] | None, str]:
    """Each (name, cap MiB, command, output) in its own fresh group, removed afterwards. None: no groups possible."""
    capped, note = [], ""
    for name, cap, cmd, scratch in jobs:
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            group, has_memsw = make_cgroup(root, f"merge-bench-{os.getpid()}-{name}-{cap}", cap)
        except OSError as e:
            note = f"could not create a capped memory cgroup under {root} ({e})"
            print(f"memory caps skipped: {note}", flush=True)
            return None, note
        note = "child groups of this process's memory group, `memory.limit_in_bytes` = " + (
            "`memory.memsw.limit_in_bytes` (RAM + swap: no escape to swap)"
            if has_memsw
            else "the cap (no memsw file: swap, if any, is not limited)"
        )
        try:
            r = measure(name, cmd, logs / f"{name}-cap{cap}.log", cold=cold, cgroup=group, timeout=timeout)
            r.cap_mib, r.oom_kills, r.major_faults = cap, oom_kills(group), _stat(group, "pgmajfault")
            r.cgroup_peak_mib = int((group / "memory.max_usage_in_bytes").read_text()) / MiB
        finally:
            remove_cgroup(group)
            shutil.rmtree(scratch, ignore_errors=True)
        print(f"  {name:16s} under {cap} MiB: {r.status}, {r.wall_s:.1f} s, peak RSS {r.peak_rss_mib:.0f} MiB")
        capped.append(r)
    return capped, note


def _stat(group: Path, key: str) -> int | None:
    for line in (group / "memory.stat").read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return None


def oom_kills(group: Path) -> int:
    for line in (group / "memory.oom_control").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


# ------------------------------------------------------------------------------------------------------ comparing


def tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the .safetensors file of `folder` holding it."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys() but is not a mapping
                where[name] = path
    return where


def compare_outputs(converter_out: Path, peft_out: Path, base: Path, adapter: Path) -> Comparison:
    """Load tensors one at a time (never a whole model) and compare bits, values and a float64 reference."""
    import torch
    from safetensors import safe_open

    cmp = Comparison()
    ours, theirs, base_files = tensor_files(converter_out), tensor_files(peft_out), tensor_files(base)
    cmp.names_converter, cmp.names_peft = len(ours), len(theirs)
    cmp.only_converter = sorted(set(ours) - set(theirs))
    cmp.only_peft = sorted(set(theirs) - set(ours))

    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / (config["r"] ** 0.5 if config.get("use_rslora") else config["r"])
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        lora = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118

    def read(where: dict[str, Path], name: str) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as f:
            return f.get_tensor(name)

    for name in sorted(set(ours) & set(theirs)):
        a, b = read(ours, name), read(theirs, name)
        cmp.compared += 1
        if a.shape != b.shape or a.dtype != b.dtype:
            cmp.elements_differing += max(a.numel(), b.numel())
            continue
        cmp.elements += a.numel()
        differing = int((_bits(a) != _bits(b)).sum())
        cmp.elements_differing += differing
        cmp.bit_identical += differing == 0
        if a.is_floating_point():
            cmp.max_abs_diff = max(cmp.max_abs_diff, float((a.double() - b.double()).abs().max()))
        if name in base_files:
            w = read(base_files, name)
            changed = not torch.equal(_bits(w), _bits(a))
            cmp.changed_vs_base += changed
            module = name.removesuffix(".weight")
            key_a, key_b = f"base_model.model.{module}.lora_A.weight", f"base_model.model.{module}.lora_B.weight"
            if key_a in lora and key_b in lora:
                exact = (w.double() + scale * (lora[key_b].double() @ lora[key_a].double())).to(a.dtype)
                cmp.ref_tensors += 1
                cmp.ref_elements += a.numel()
                cmp.converter_off_ref += int((_bits(a) != _bits(exact)).sum())
                cmp.peft_off_ref += int((_bits(b) != _bits(exact)).sum())
    return cmp


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers of the same width (so -0.0 != 0.0 and NaN == NaN bitwise)."""
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width)


# -------------------------------------------------------------------------------------------------------- reports


def machine_info() -> dict[str, str]:
    """What the numbers depend on: cores, RAM, CPU, library versions."""
    cpuinfo = _read("/proc/cpuinfo").splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "unknown")
    mem_kib = next(
        (int(line.split()[1]) for line in _read("/proc/meminfo").splitlines() if line.startswith("MemTotal:")), 0
    )
    versions = []
    for pkg in ("torch", "transformers", "peft", "safetensors", "converter"):
        try:
            versions.append(f"{pkg} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{pkg} missing")
    try:
        date = subprocess.run(["date"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        date = time.strftime("%a %b %d %H:%M:%S %Z %Y")
    try:
        head = subprocess.run(
            ["git", "-C", str(BENCH_DIR), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(BENCH_DIR), "status", "--porcelain", "--", "../converter"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        source = f"commit {head}" + (" with uncommitted changes in converter/" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        source = "unknown (not a git checkout)"
    return {
        "date": date,
        "source": source,
        "cores": str(len(os.sched_getaffinity(0))),
        "ram": f"{mem_kib / 2**20:.1f} GiB",
        "cpu": cpu,
        "python": platform.python_version(),
        "versions": ", ".join(versions),
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def render(
    info: dict[str, str],
    argv: list[str],
    shape: Shape,
    params: str,
    cold: bool,
    runs: list[RunResult],
    capped: list[RunResult] | None,
    cap_note: str,
    cmp: Comparison,
    conv_flags: str,
) -> str:
    """The Markdown section for one benchmark run (also printed). With repeats, ratios use each tool's fastest run."""
    caches = [c for c in ("warm", "cold") if any(r.cache == c for r in runs)]
    best = {
        (n, c): min((r for r in runs if r.name == n and r.cache == c), key=lambda r: r.wall_s)
        for n in TOOLS
        for c in caches
        if any(r.name == n and r.cache == c for r in runs)
    }
    repeats = sum(r.name == "converter" for r in runs) // max(1, len(caches))
    verify_run = next((r for r in runs if r.name == VERIFY_RUN), None)
    lines = [
        f"## Run of {info['date']}",
        "",
        f"- Machine: {info['cores']} cores, {info['ram']} RAM, CPU `{info['cpu']}`, Python {info['python']}",
        f"- Versions: {info['versions']}; converter source: {info['source']}",
        f"- Load average at start: {info['load']} (other work on the machine makes timings noisy)",
        f"- Command: `{' '.join(argv)}`; (a) is `converter merge --base B --adapter A --out O {conv_flags}`",
        f"- Model: {shape.tag}, bf16, {params}; adapter: PEFT LoRA r={LORA_RANK}, alpha={LORA_ALPHA}, all-linear",
        "- Page cache: "
        + (
            "cold runs: dropped before the run (`sync; echo 3 > /proc/sys/vm/drop_caches`); warm runs: the base "
            "folder read once just before the run; the tools alternate within each round"
            if cold
            else "could not be dropped (not root?): all runs are warm"
        ),
        "",
        "| run | cache | exit | wall time (s) | wall + `sync` (s) | CPU user+sys (s) | peak RSS (MiB) | load avg |",
        "|---|---|---|---|---|---|---|---|",
    ]
    seen: dict[tuple[str, str], int] = {}
    for r in runs:
        seen[r.name, r.cache] = seen.get((r.name, r.cache), 0) + 1
        label = LABELS[r.name] + (
            f" #{seen[r.name, r.cache]}" if repeats > 1 and r.name in (*TOOLS, BASELINE_RUN) else ""
        )
        lines.append(
            f"| {label} | {r.cache} | {r.rc} | {r.wall_s:.2f} | {r.wall_s + r.sync_s:.2f} | {r.cpu_s:.2f} "
            f"| {r.peak_rss_mib:.0f} | {r.load1:.2f} |"
        )
    lines += ["", f"Ratios{' (fastest of each tool)' if repeats > 1 else ''}:", ""]
    speedups, floors = {}, {}
    for c in caches:
        conv, peft, copy, imports = (best[n, c] for n in TOOLS)
        floor = copy.wall_s + imports.wall_s
        speedups[c], floors[c] = peft.wall_s / conv.wall_s, conv.wall_s / floor
        lines += [
            f"- {c}: PEFT / converter time **{speedups[c]:.2f}x** (CPU time {peft.cpu_s / conv.cpu_s:.2f}x; with "
            f"final sync {(peft.wall_s + peft.sync_s) / (conv.wall_s + conv.sync_s):.2f}x); converter / floor "
            f"(copy {copy.wall_s:.2f} s + interpreter start {imports.wall_s:.2f} s = {floor:.2f} s) "
            f"**{floors[c]:.2f}x** (with final sync, converter {conv.wall_s + conv.sync_s:.2f} s vs "
            f"{floor + copy.sync_s:.2f} s: {(conv.wall_s + conv.sync_s) / (floor + copy.sync_s):.2f}x); "
            f"PEFT / converter peak RSS {peft.peak_rss_mib / conv.peak_rss_mib:.1f}x",
        ]
    for c in caches:
        baseline = [r for r in runs if r.name == BASELINE_RUN and r.cache == c]
        if baseline:
            old = min(baseline, key=lambda r: r.wall_s)
            conv = best["converter", c]
            lines.append(
                f"- {c}: {LABELS[BASELINE_RUN]} / converter time **{old.wall_s / conv.wall_s:.2f}x** "
                f"(CPU time {old.cpu_s / conv.cpu_s:.2f}x); its peak RSS {old.peak_rss_mib:.0f} MiB"
            )
    if verify_run:
        peft = best["peft", verify_run.cache]
        lines.append(
            "- The default command (a') verifies its output after merging: "
            f"PEFT / (a') time **{peft.wall_s / verify_run.wall_s:.2f}x**, peak RSS {verify_run.peak_rss_mib:.0f} MiB"
        )
    lines.append("")
    if capped is None:
        lines.append(f"Memory caps: skipped ({cap_note}).")
    else:
        lines += [
            f"Memory caps (cgroup v1; {cap_note}; page cache is charged to the group and reclaimed under the cap):",
            "",
            "| run | cap | result | wall time (s) | peak RSS (MiB) | group peak incl. cache (MiB) | load avg |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in capped:
            group_peak = f"{r.cgroup_peak_mib:.0f}" if r.cgroup_peak_mib is not None else "-"
            rss = f"{r.peak_rss_mib:.0f}" if r.peak_rss_mib else "- (not reported)"
            lines.append(
                f"| {LABELS[r.name]} | {r.cap_mib} MiB | {r.status} | {r.wall_s:.1f} | {rss} "
                f"| {group_peak} | {r.load1:.2f} |"
            )
        lines += [
            "",
            "(Peak RSS can exceed the cap: it also counts pages of shared libraries such as libtorch that are "
            "charged to whichever group read them first.)",
        ]
    same_names = not cmp.only_converter and not cmp.only_peft
    lines += [
        "",
        f"Outputs compared tensor by tensor (safetensors `safe_open`): {cmp.compared} tensors in common "
        f"({cmp.names_converter} in converter's output, {cmp.names_peft} in PEFT's"
        + ("" if same_names else f"; only converter: {cmp.only_converter[:3]}, only PEFT: {cmp.only_peft[:3]}")
        + ").",
        f"- bit-identical tensors: **{cmp.bit_identical} of {cmp.compared}**; differing elements: "
        f"{cmp.elements_differing:,} of {cmp.elements:,} ({_pct(cmp.elements_differing, cmp.elements)}); "
        f"max abs difference: {cmp.max_abs_diff:.3g}",
        f"- tensors the merge changed (converter output vs base): {cmp.changed_vs_base}",
        "- (a)'s weight files vs the same merge on numpy alone (`CONVERTER_NO_KERNEL=1`): "
        + {True: "**byte-identical**", False: "**DIFFERENT**", None: "not compared"}[cmp.numpy_path_identical],
    ]
    if cmp.ref_tensors:
        lines.append(
            f"- vs W + scale·B@A computed in float64 and rounded once to bf16 ({cmp.ref_tensors} LoRA tensors, "
            f"{cmp.ref_elements:,} elements): converter differs in {cmp.converter_off_ref:,} "
            f"({_pct(cmp.converter_off_ref, cmp.ref_elements)}), PEFT in {cmp.peft_off_ref:,} "
            f"({_pct(cmp.peft_off_ref, cmp.ref_elements)})"
        )
    conv_capped = [r for r in capped or [] if r.name == "converter" and r.cap_mib == TARGET_CAP_MIB]
    verify_capped = [r for r in capped or [] if r.name == VERIFY_RUN]
    cap_met = "not measured" if not conv_capped else ("met" if conv_capped[0].ok else "**missed**")
    verdict = lambda ok: "met" if ok else "**missed**"  # noqa: E731
    lines += [
        "",
        "Targets (for the merge, (a)): "
        + "; ".join(
            f"{c}: ≥ {TARGET_SPEEDUP:.0f}x faster than PEFT {verdict(speedups[c] >= TARGET_SPEEDUP)} "
            f"({speedups[c]:.2f}x), within {TARGET_FLOOR:.0f}x of the floor {verdict(floors[c] <= TARGET_FLOOR)} "
            f"({floors[c]:.2f}x)"
            for c in caches
        )
        + f"; converter finishes under a {TARGET_CAP_MIB} MiB cap: {cap_met}.",
    ]
    if verify_run:
        v_speed = best["peft", verify_run.cache].wall_s / verify_run.wall_s
        v_cap = "not measured" if not verify_capped else ("met" if verify_capped[0].ok else "**missed**")
        lines.append(
            f"The default command (a'): ≥ {TARGET_SPEEDUP:.0f}x faster: "
            + ("met" if v_speed >= TARGET_SPEEDUP else "**missed**")
            + f" ({v_speed:.2f}x); under {TARGET_CAP_MIB} MiB: {v_cap}."
        )
    lines.append("")
    return "\n".join(lines)


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.4f}%" if whole else "-"


RESULTS_HEADER = """# Merge benchmark results

Measured by `bench/merge_bench.py` (see bench/README.md). Each "Run of" section is one full run, appended by the
script. Timings on a shared machine are noisy: compare runs, not single numbers.

"""


# ------------------------------------------------------------------------------------------------- larger than RAM

HUGE_HIDDEN, HUGE_INTERMEDIATE, HUGE_VOCAB = 4096, 11008, 32000
HUGE_SHARD = 5 * 2**30
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _huge_tensors(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    h, i = HUGE_HIDDEN, HUGE_INTERMEDIATE
    out = [("model.embed_tokens.weight", (HUGE_VOCAB, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        out += [(p + f"self_attn.{m}.weight", (h, h)) for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
        out += [(p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h))]
        out += [(p + "mlp.down_proj.weight", (h, i))]
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (HUGE_VOCAB, h))]


def build_huge(gb: float, folder: Path) -> tuple[Path, Path, int]:
    """A Llama-shaped bf16 base of about `gb` GB written straight to disk (a 64 MiB block of random finite bf16
    values repeated: no RAM needed), and a rank-16 PEFT LoRA on its linear layers. Returns (base, adapter, bytes)."""
    import numpy as np
    from safetensors.numpy import save_file

    per_layer = (4 * HUGE_HIDDEN**2 + 3 * HUGE_HIDDEN * HUGE_INTERMEDIATE) * 2
    layers = max(1, round((gb * 1e9 - 4 * HUGE_VOCAB * HUGE_HIDDEN) / per_layer))
    base, adapter, marker = folder / "base", folder / "adapter", folder / ".complete"
    tag = f"huge-l{layers}"
    if marker.is_file() and marker.read_text() == tag:
        return base, adapter, sum(p.stat().st_size for p in base.glob("*.safetensors"))
    shutil.rmtree(folder, ignore_errors=True)
    base.mkdir(parents=True)
    adapter.mkdir()
    print(f"building a {layers}-layer synthetic model of ~{gb:.0f} GB in {folder} ...", flush=True)
    rng = np.random.default_rng(0)
    block = (rng.standard_normal(32 * MiB, dtype=np.float32) * 0.02).view(np.uint32) >> 16
    block = memoryview(block.astype(np.uint16)).cast("B")
    shards, size = [[]], 0
    for name, shape in _huge_tensors(layers):
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > HUGE_SHARD:
            shards.append([])
            size = 0
        shards[-1].append((name, shape, nbytes))
        size += nbytes
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards, strict=True):
        header, offset = {}, 0
        for name, shape, nbytes in shard:
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(base / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for _, _, nbytes in shard:
                while nbytes:
                    n = min(nbytes, len(block))
                    f.write(block[:n])
                    nbytes -= n
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    total = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    (base / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HUGE_HIDDEN,
        "intermediate_size": HUGE_INTERMEDIATE, "num_hidden_layers": layers, "num_attention_heads": 32,
        "num_key_value_heads": 32, "vocab_size": HUGE_VOCAB, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "max_position_embeddings": 4096,
    }  # fmt: skip
    (base / "config.json").write_text(json.dumps(config, indent=2))
    lora = {}
    for name, shape in _huge_tensors(layers):
        module = name.rsplit(".", 1)[0]
        if module.rsplit(".", 1)[-1] in LORA_TARGETS:
            out_f, in_f = shape
            lora[f"base_model.model.{module}.lora_A.weight"] = rng.standard_normal((LORA_RANK, in_f), np.float32) * 0.01
            lora[f"base_model.model.{module}.lora_B.weight"] = (
                rng.standard_normal((out_f, LORA_RANK), np.float32) * 0.01
            )
    save_file(lora, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": LORA_ALPHA,
        "target_modules": list(LORA_TARGETS), "base_model_name_or_path": str(base), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False,
    }))  # fmt: skip
    marker.write_text(tag)
    print(f"  {total / 1e9:.1f} GB in {len(names)} shards", flush=True)
    return base, adapter, total


def run_huge(gb: float, work: Path, logs: Path, converter_cmd: list[str], cold: bool, timeout: float) -> list[str]:
    """Merge the larger-than-RAM model under the target cap, and `cp -r` it under the same cap; Markdown lines."""
    root = memory_cgroup_root()
    if root is None:
        return ["Larger-than-RAM run: skipped (no writable cgroup v1 memory controller)."]
    base, adapter, total = build_huge(gb, work / "huge")
    out = work / "huge-out"
    jobs = {
        "copy": ["cp", "-r", str(base), str(out)],
        "converter": [*converter_cmd, "merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out),
                      "--force", "--no-verify"],
    }  # fmt: skip
    results = []
    for name, cmd in jobs.items():
        capped, note = run_capped(root, [(name, TARGET_CAP_MIB, cmd, out)], logs, cold, timeout)
        shutil.rmtree(out, ignore_errors=True)
        if capped is None:
            return [f"Larger-than-RAM run: skipped ({note})."]
        results += capped
        r = capped[0]
        print(f"  huge {name:10s} exit {r.rc}  {r.wall_s:7.1f} s  {total / 1e9 / r.wall_s:.2f} GB/s", flush=True)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    lines = [
        f"Larger than RAM: a synthetic Llama-shaped bf16 base of {total / 1e9:.1f} GB ({total / ram:.2f}x this "
        f"machine's {ram / 2**30:.1f} GiB of RAM), rank-{LORA_RANK} LoRA on every linear layer, each run cold in its "
        f"own {TARGET_CAP_MIB} MiB cgroup (page cache charged to it):",
        "",
        "| run | result | wall time (s) | GB/s of base | peak RSS (MiB) | group peak incl. cache (MiB) | load avg |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        label = "`cp -r` base" if r.name == "copy" else "`converter merge --no-verify`"
        peak = f"{r.cgroup_peak_mib:.0f}" if r.cgroup_peak_mib is not None else "-"
        lines.append(
            f"| {label} | {r.status} | {r.wall_s:.1f} | {total / 1e9 / r.wall_s:.2f} | {r.peak_rss_mib:.0f} "
            f"| {peak} | {r.load1:.2f} |"
        )
    copy, conv = results
    if conv.ok and copy.ok:
        lines += ["", f"converter / cp time under the cap: **{conv.wall_s / copy.wall_s:.2f}x**."]
    shutil.rmtree(work / "huge", ignore_errors=True)  # 26+ GB: never left behind
    return [*lines, ""]


# ------------------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=BENCH_DIR / "work", help="cache and outputs (bench/work)")
    parser.add_argument("--small", action="store_true", help="a much smaller model: a quick smoke run")
    parser.add_argument("--repeat", type=int, default=1, help="run the three tools N times, interleaved")
    parser.add_argument(
        "--skip-verify-run", action="store_true", help="skip the extra run of the default (verifying) `converter merge`"
    )
    parser.add_argument(
        "--cap-timeout", type=float, default=CAP_TIMEOUT_S, help="seconds before a capped run counts as not finishing"
    )
    parser.add_argument("--no-caps", action="store_true", help="skip the runs under cgroup memory caps")
    parser.add_argument(
        "--cache", choices=("both", "cold", "warm"), default="both", help="page cache before each run (root: both)"
    )
    parser.add_argument(
        "--huge", type=float, default=0, metavar="GB",
        help="also merge a synthetic model of GB gigabytes (larger than RAM) under the cap, vs cp under it",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", default=BASELINE_REF, metavar="REF",
        help=f"also run `converter merge` of this git ref's tree, (e) (default {BASELINE_REF}: the torch path)",
    )  # fmt: skip
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    parser.add_argument("--results", type=Path, default=BENCH_DIR / "RESULTS.md", help="where results are appended")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the running tool, remove cgroups
    shape = SMALL if args.small else FULL
    work = args.workdir.resolve() / ("small" if args.small else "full")
    logs = work / "logs"

    info = machine_info()  # before anything runs: the load average is the other work on the machine
    base, adapter = build_inputs(shape, work / "inputs")
    logs.mkdir(parents=True, exist_ok=True)
    params = _param_count(base)
    out_conv, out_peft, out_copy = work / "out-converter", work / "out-peft", work / "out-copy"
    converter_bin = Path(sys.executable).parent / "converter"
    converter_cmd = [str(converter_bin)] if converter_bin.is_file() else [sys.executable, "-m", "converter"]
    help_text = subprocess.run([*converter_cmd, "merge", "--help"], capture_output=True, text=True).stdout
    verifies = "--no-verify" in help_text  # newer CLIs verify every merge unless told not to

    def merge_cmd(out: Path, verify: bool = False) -> list[str]:
        flags = ["--no-verify"] if verifies and not verify else []
        return [
            *converter_cmd,
            "merge",
            "--base",
            str(base),
            "--adapter",
            str(adapter),
            "--out",
            str(out),
            "--force",
        ] + (flags)

    def peft_cmd(out: Path) -> list[str]:
        return [sys.executable, "-c", PEFT_SCRIPT, str(base), str(adapter), str(out)]

    commands = {
        "converter": merge_cmd(out_conv),
        "peft": peft_cmd(out_peft),
        "copy": ["cp", "-r", str(base), str(out_copy)],
        "imports": [*converter_cmd[:-2], "-c", "import converter.cli, converter.engine.merging"]
        if converter_cmd[-2:] == ["-m", "converter"]
        else [sys.executable, "-c", "import converter.cli, converter.engine.merging"],
    }
    outputs = {"converter": out_conv, "peft": out_peft, "copy": out_copy, "imports": work / "out-none"}
    if args.baseline:
        tree = baseline_tree(args.baseline, work)
        LABELS[BASELINE_RUN] = f"(e) `converter merge` of {args.baseline}"
        run_tree = f"import sys; sys.path.insert(0, {str(tree)!r}); from converter.cli import main; sys.exit(main())"
        old = [sys.executable, "-c", run_tree, *merge_cmd(work / "out-baseline")[len(converter_cmd) :]]
        cli = tree / "converter" / "cli.py"
        cli = cli if cli.is_file() else tree / "converter" / "cli" / "commands.py"
        if "--no-verify" not in cli.read_text():  # a CLI from before verification
            old = [a for a in old if a != "--no-verify"]
        commands[BASELINE_RUN], outputs[BASELINE_RUN] = old, work / "out-baseline"
    out_verify = work / "out-converter-verify"
    verify_run = verifies and not args.skip_verify_run

    cold = drop_caches()
    print(
        f"model {shape.tag}: {params}; page cache "
        + ("dropped before every run (cold)" if cold else "cannot be dropped: warming up each tool once first"),
        flush=True,
    )
    if not cold:
        for name, cmd in commands.items():
            shutil.rmtree(outputs[name], ignore_errors=True)
            measure(name, cmd, logs / f"{name}-warmup.log", cold=False)
    runs = []
    caches = ("warm", "cold") if args.cache == "both" and cold else (args.cache if cold else "warm",)
    rounds = [(i, c) for i in range(args.repeat) for c in caches]
    for i, cache in rounds:
        for name, cmd in commands.items():
            shutil.rmtree(outputs[name], ignore_errors=True)
            # warm: nothing dropped (libraries stay cached) and the base read just before; cold: everything dropped
            warm = base if cache == "warm" and name != "imports" else None
            log = logs / f"{name}-{cache}-{i + 1}.log"
            r = measure(name, cmd, log, cold=cold and cache == "cold", warm=warm)
            r.cache = cache
            print(
                f"  {name:10s} {r.cache}  exit {r.rc}  {r.wall_s:6.2f} s (+{r.sync_s:.1f} s sync)  "
                f"CPU {r.cpu_s:6.2f} s  "
                f"peak RSS {r.peak_rss_mib:6.0f} MiB  (load {r.load1:.2f})",
                flush=True,
            )
            if not r.ok:
                print(_tail(r.log), file=sys.stderr)
                break
            runs.append(r)
        else:
            continue
        break
    shutil.rmtree(out_copy, ignore_errors=True)
    if len(runs) != len(commands) * len(rounds):
        print("a run failed (logs above); not comparing or recording", file=sys.stderr)
        return 1
    if verify_run:
        r = measure(VERIFY_RUN, merge_cmd(out_verify, verify=True), logs / f"{VERIFY_RUN}.log", cold=cold, warm=base)
        shutil.rmtree(out_verify, ignore_errors=True)
        print(f"  {VERIFY_RUN:16s} exit {r.rc}  {r.wall_s:6.1f} s  peak RSS {r.peak_rss_mib:6.0f} MiB", flush=True)
        if not r.ok:
            print(_tail(r.log), file=sys.stderr)
        runs.append(r)

    capped, cap_note = None, ""
    root = memory_cgroup_root()
    if args.no_caps:
        cap_note = "--no-caps"
    elif root is None:
        cap_note = "no writable cgroup v1 memory controller here (needs root and /sys/fs/cgroup/memory)"
        print(f"memory caps skipped: {cap_note}", flush=True)
    else:
        conv_out, peft_out = work / "out-converter-capped", work / "out-peft-capped"
        jobs = [
            job
            for cap in CAPS_MIB
            for job in (("converter", cap, merge_cmd(conv_out), conv_out), ("peft", cap, peft_cmd(peft_out), peft_out))
        ]
        if verify_run:  # the default command, at the target cap only
            jobs.append((VERIFY_RUN, TARGET_CAP_MIB, merge_cmd(conv_out, verify=True), conv_out))
        capped, cap_note = run_capped(root, jobs, logs, cold, args.cap_timeout)

    huge_lines = run_huge(args.huge, work, logs, converter_cmd, cold, args.cap_timeout * 20) if args.huge else []

    print("comparing outputs tensor by tensor ...", flush=True)
    cmp = compare_outputs(out_conv, out_peft, base, adapter)
    # The same merge on numpy alone (no compiled fused step, converter.engine.npkernel): the output must be the
    # same bytes.
    out_numpy = work / "out-converter-numpy"
    shutil.rmtree(out_numpy, ignore_errors=True)
    numpy_rc = subprocess.call([*merge_cmd(out_numpy)], env=os.environ | {"CONVERTER_NO_KERNEL": "1"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
    cmp.numpy_path_identical = numpy_rc == 0 and all(
        filecmp.cmp(f, out_numpy / f.name, shallow=False) for f in sorted(out_conv.glob("*.safetensors"))
    )
    shutil.rmtree(out_numpy, ignore_errors=True)
    shutil.rmtree(out_conv, ignore_errors=True)
    shutil.rmtree(out_peft, ignore_errors=True)

    conv_flags = " ".join(commands["converter"][commands["converter"].index("--force") :])
    shown_argv = ["python", "bench/merge_bench.py", *(argv if argv is not None else sys.argv[1:])]
    section = render(info, shown_argv, shape, params, cold, runs, capped, cap_note, cmp, conv_flags)
    section += "\n".join(huge_lines)
    print()
    print(section)
    if not (args.no_record or args.small):
        if not args.results.is_file():
            args.results.write_text(RESULTS_HEADER)
        with open(args.results, "a") as f:
            f.write(section + "\n")
        print(f"appended to {args.results}")
    return 0


def baseline_tree(ref: str, work: Path) -> Path:
    """`git archive` of `ref`'s converter package and keymaps, made once."""
    tree = work / f"baseline-{ref}"
    if not (tree / "converter").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(BENCH_DIR.parent), "archive", ref, "converter", "keymaps"],
                                 capture_output=True, check=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def _param_count(base: Path) -> str:
    """Parameters and bytes of the base, from the safetensors index or headers (no tensor data read)."""
    count, size = 0, 0
    for path in sorted(base.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        header.pop("__metadata__", None)
        for entry in header.values():
            n = 1
            for d in entry["shape"]:
                n *= d
            count += n
        size += path.stat().st_size
    return f"{count / 1e9:.3f} B parameters, {size / 2**30:.2f} GiB of safetensors"


def _tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


if __name__ == "__main__":
    sys.exit(main())
