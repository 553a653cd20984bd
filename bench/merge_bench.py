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
import json
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
TOOLS = {"converter": "(a) `converter merge`", "peft": "(b) PEFT `merge_and_unload`", "copy": "(c) `cp -r` base"}
# `converter merge` verifies its output by default (since the CLI has --no-verify): (a) is the merge alone, the
# comparison the targets are about; this extra run, once per benchmark, is what the default command costs.
VERIFY_RUN = "converter-verify"
LABELS = {**TOOLS, VERIFY_RUN: "(a') `converter merge`, default: merge + verification"}
MiB = 2**20
CAPS_MIB = (768, 1024)
RUN_TIMEOUT_S = 3600
# Near its cap a process can thrash (code pages evicted and re-read) for a very long time instead of being killed.
CAP_TIMEOUT_S = 300
TARGET_SPEEDUP = 4.0  # converter vs PEFT, from the issue
TARGET_CAP_MIB = 768  # converter must finish under this cap, from the issue

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


# ---------------------------------------------------------------------------------------------------------- inputs


def build_inputs(shape: Shape, folder: Path) -> tuple[Path, Path]:
    """Create (once) a random-init bf16 Llama base and a non-zero rank-16 all-linear PEFT LoRA for it."""
    base_dir, adapter_dir, marker = folder / "base", folder / "adapter", folder / ".complete"
    if marker.is_file() and marker.read_text() == shape.tag:
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
    model.save_pretrained(base_dir, max_shard_size="1GB")
    lora = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(adapter_dir)
    del model
    marker.write_text(shape.tag)
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


def measure(
    name: str, cmd: list[str], log: Path, cold: bool, cgroup: Path | None = None, timeout: float = RUN_TIMEOUT_S
) -> RunResult:
    """Run `cmd` once; wall time until it exits, then the time a global `sync` takes, and its own peak RSS.

    Peak RSS comes from a tiny launcher (GNU time, else a bare Python) that forks the tool: Linux carries the
    high-water RSS of the process that execs into the child's ru_maxrss, so this (possibly large) process must not
    be the tool's direct parent.
    """
    if cold:
        drop_caches()
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
    return RunResult(name, rc, wall, sync_s, maxrss_kib / 1024, log, cpu_s=cpu_s, load1=load1, timed_out=timed_out)


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
        note = f"groups under `{root}`, `memory.limit_in_bytes` = " + (
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
    conv, peft, copy = (min((r for r in runs if r.name == n), key=lambda r: r.wall_s) for n in TOOLS)
    repeats = sum(r.name == "converter" for r in runs)
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
            "dropped before every run (`sync; echo 3 > /proc/sys/vm/drop_caches`): every run starts cold"
            if cold
            else "could not be dropped (not root?): each tool ran once as warm-up first; runs are warm"
        ),
        "",
        "| run | exit | wall time (s) | wall + `sync` (s) | CPU user+sys (s) | peak RSS (MiB) | load avg at start |",
        "|---|---|---|---|---|---|---|",
    ]
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.name] = seen.get(r.name, 0) + 1
        label = LABELS[r.name] + (f" #{seen[r.name]}" if repeats > 1 and r.name in TOOLS else "")
        lines.append(
            f"| {label} | {r.rc} | {r.wall_s:.1f} | {r.wall_s + r.sync_s:.1f} | {r.cpu_s:.1f} | {r.peak_rss_mib:.0f} "
            f"| {r.load1:.2f} |"
        )
    speedup = peft.wall_s / conv.wall_s
    lines += [
        "",
        f"Ratios{' (fastest of each tool)' if repeats > 1 else ''}:",
        "",
        f"- PEFT / converter time: **{speedup:.2f}x** (CPU time: {peft.cpu_s / conv.cpu_s:.2f}x; with final sync: "
        f"{(peft.wall_s + peft.sync_s) / (conv.wall_s + conv.sync_s):.2f}x)",
        f"- converter / copy time: **{conv.wall_s / copy.wall_s:.2f}x** (with final sync: "
        f"{(conv.wall_s + conv.sync_s) / (copy.wall_s + copy.sync_s):.2f}x)",
        f"- PEFT / converter peak RSS: {peft.peak_rss_mib / conv.peak_rss_mib:.1f}x",
        *(
            [
                "- The default command (a') verifies its output after merging: "
                f"PEFT / (a') time **{peft.wall_s / verify_run.wall_s:.2f}x**, "
                f"peak RSS {verify_run.peak_rss_mib:.0f} MiB"
            ]
            if verify_run
            else []
        ),
        "",
    ]
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
    lines += [
        "",
        f"Targets (for the merge, (a)): converter ≥ {TARGET_SPEEDUP:.0f}x faster than PEFT: "
        + ("met" if speedup >= TARGET_SPEEDUP else "**missed**")
        + f" ({speedup:.2f}x); converter finishes under a {TARGET_CAP_MIB} MiB cap: {cap_met}.",
    ]
    if verify_run:
        v_speed = peft.wall_s / verify_run.wall_s
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
    }
    outputs = {"converter": out_conv, "peft": out_peft, "copy": out_copy}
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
    for i in range(args.repeat):
        for name, cmd in commands.items():
            shutil.rmtree(outputs[name], ignore_errors=True)
            r = measure(name, cmd, logs / f"{name}-{i + 1}.log", cold=cold)
            print(
                f"  {name:16s} exit {r.rc}  {r.wall_s:6.1f} s (+{r.sync_s:.1f} s sync)  CPU {r.cpu_s:6.1f} s  "
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
    if len(runs) != len(commands) * args.repeat:
        print("a run failed (logs above); not comparing or recording", file=sys.stderr)
        return 1
    if verify_run:
        r = measure(VERIFY_RUN, merge_cmd(out_verify, verify=True), logs / f"{VERIFY_RUN}.log", cold=cold)
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

    print("comparing outputs tensor by tensor ...", flush=True)
    cmp = compare_outputs(out_conv, out_peft, base, adapter)
    shutil.rmtree(out_conv, ignore_errors=True)
    shutil.rmtree(out_peft, ignore_errors=True)

    conv_flags = " ".join(commands["converter"][commands["converter"].index("--force") :])
    shown_argv = ["python", "bench/merge_bench.py", *(argv if argv is not None else sys.argv[1:])]
    section = render(info, shown_argv, shape, params, cold, runs, capped, cap_note, cmp, conv_flags)
    print()
    print(section)
    if not (args.no_record or args.small):
        if not args.results.is_file():
            args.results.write_text(RESULTS_HEADER)
        with open(args.results, "a") as f:
            f.write(section + "\n")
        print(f"appended to {args.results}")
    return 0


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
