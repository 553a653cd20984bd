"""Benchmark `converter merge` against PEFT's merge_and_unload and a plain folder copy.

Why: the project claims a streaming merge is much faster and much smaller in memory than loading the model with
transformers + PEFT. This script measures that on a synthetic Llama-shaped ~0.86 B model (bf16) with a rank-16
all-linear LoRA, checks that both merges give the same weights, and tries both under cgroup memory caps.

    python bench/merge_bench.py [--workdir DIR] [--small] [--no-record]

Each tool runs in its own subprocess; wall time is measured here, peak RSS comes from the kernel's rusage of that
one child (os.wait4). As root the page cache is dropped before every run, so each run reads its input cold.
Results are appended to bench/RESULTS.md (not for --small). Inputs are built once and cached in the workdir.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
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
MiB = 2**20
CAPS_MIB = (768, 1024)
RUN_TIMEOUT_S = 3600
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
        f.write(f"maxrss_kib={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}\\n")
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
    cap_mib: int | None = None
    oom_kills: int = 0
    cgroup_peak_mib: float | None = None  # memory.max_usage_in_bytes: RSS plus charged page cache

    @property
    def ok(self) -> bool:
        return self.rc == 0

    @property
    def status(self) -> str:
        if self.ok:
            return "finished (exit 0)"
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


def measure(name: str, cmd: list[str], log: Path, cold: bool, cgroup: Path | None = None) -> RunResult:
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
        launcher = ["/usr/bin/time", "-f", "maxrss_kib=%M", "-o", str(stat)]
    else:
        launcher = [sys.executable, "-S", "-c", LAUNCHER, str(stat)]
    full = [*launcher, *cmd]
    if cgroup is not None:  # the shell joins the group, then becomes the launcher; the tool inherits the group
        full = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *full]
    with open(log, "w") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        t0 = time.perf_counter()
        proc = subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    subprocess.run(["sync"], check=False)
    sync_s = time.perf_counter() - t1
    maxrss_kib = 0
    for line in stat.read_text().splitlines() if stat.is_file() else []:
        if line.startswith("maxrss_kib="):
            maxrss_kib = int(line.split("=", 1)[1])
        elif line.startswith("Command terminated by signal"):
            rc = -int(line.split()[-1])  # the launcher exits 128+N; report the signal itself
    return RunResult(name, rc, wall, sync_s, maxrss_kib / 1024, log)


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
    limit = str(cap_mib * MiB)
    (group / "memory.limit_in_bytes").write_text(limit)
    memsw = group / "memory.memsw.limit_in_bytes"
    has_memsw = memsw.is_file()
    if has_memsw:
        memsw.write_text(limit)
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
) -> str:
    """The Markdown section for one benchmark run (also printed)."""
    by = {r.name: r for r in runs}
    conv, peft, copy = by["converter"], by["peft"], by["copy"]
    lines = [
        f"## Run of {info['date']}",
        "",
        f"- Machine: {info['cores']} cores, {info['ram']} RAM, CPU `{info['cpu']}`, Python {info['python']}",
        f"- Versions: {info['versions']}; converter source: {info['source']}",
        f"- Load average at start: {info['load']} (other work on the machine makes timings noisy)",
        f"- Command: `{' '.join(argv)}`",
        f"- Model: {shape.tag}, bf16, {params}; adapter: PEFT LoRA r={LORA_RANK}, alpha={LORA_ALPHA}, all-linear",
        "- Page cache: "
        + (
            "dropped before every run (`sync; echo 3 > /proc/sys/vm/drop_caches`): every run starts cold"
            if cold
            else "could not be dropped (not root?): each tool ran once as warm-up first; runs are warm"
        ),
        "",
        "| run | exit | wall time (s) | wall + final `sync` (s) | peak RSS (MiB) |",
        "|---|---|---|---|---|",
    ]
    labels = ((conv, "(a) `converter merge`"), (peft, "(b) PEFT `merge_and_unload`"), (copy, "(c) `cp -r` base"))
    for r, label in labels:
        lines.append(f"| {label} | {r.rc} | {r.wall_s:.1f} | {r.wall_s + r.sync_s:.1f} | {r.peak_rss_mib:.0f} |")
    speedup = peft.wall_s / conv.wall_s
    lines += [
        "",
        f"- PEFT / converter time: **{speedup:.2f}x** (with final sync: "
        f"{(peft.wall_s + peft.sync_s) / (conv.wall_s + conv.sync_s):.2f}x)",
        f"- converter / copy time: **{conv.wall_s / copy.wall_s:.2f}x** (with final sync: "
        f"{(conv.wall_s + conv.sync_s) / (copy.wall_s + copy.sync_s):.2f}x)",
        f"- PEFT / converter peak RSS: {peft.peak_rss_mib / conv.peak_rss_mib:.1f}x",
        "",
        "Memory caps (cgroup v1, `memory.limit_in_bytes`"
        + (" = `memory.memsw.limit_in_bytes`, no swap" if "memsw" in cap_note else "")
        + "; page cache is charged to the group and reclaimed under the cap):",
        "",
    ]
    if capped is None:
        lines.append(f"- skipped: {cap_note}")
    else:
        lines += [
            "| run | cap | result | wall time (s) | peak RSS (MiB) | group peak incl. cache (MiB) |",
            "|---|---|---|---|---|---|",
        ]
        for r in capped:
            group_peak = f"{r.cgroup_peak_mib:.0f}" if r.cgroup_peak_mib is not None else "-"
            lines.append(
                f"| {r.name} | {r.cap_mib} MiB | {r.status} | {r.wall_s:.1f} | {r.peak_rss_mib:.0f} | {group_peak} |"
            )
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
    cap_met = "not measured" if not conv_capped else ("met" if conv_capped[0].ok else "**missed**")
    lines += [
        "",
        f"Targets: converter ≥ {TARGET_SPEEDUP:.0f}x faster than PEFT: "
        + ("met" if speedup >= TARGET_SPEEDUP else "**missed**")
        + f" ({speedup:.2f}x); converter finishes under a {TARGET_CAP_MIB} MiB cap: {cap_met}.",
        "",
    ]
    return "\n".join(lines)


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.4f}%" if whole else "-"


RESULTS_HEADER = """# Merge benchmark results

Measured by `bench/merge_bench.py` (see bench/README.md). Each section below is one full run, appended by the
script; nothing here is estimated. Timings on a shared 2-core machine are noisy: compare runs, not single numbers.

"""


# ------------------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=BENCH_DIR / "work", help="cache and outputs (bench/work)")
    parser.add_argument("--small", action="store_true", help="a much smaller model: a quick smoke run")
    parser.add_argument("--no-caps", action="store_true", help="skip the runs under cgroup memory caps")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    parser.add_argument("--results", type=Path, default=BENCH_DIR / "RESULTS.md", help="where results are appended")
    args = parser.parse_args(argv)
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
    commands = {
        "converter": [
            *converter_cmd,
            "merge",
            "--base",
            str(base),
            "--adapter",
            str(adapter),
            "--out",
            str(out_conv),
            "--force",
        ],
        "peft": [sys.executable, "-c", PEFT_SCRIPT, str(base), str(adapter), str(out_peft)],
        "copy": ["cp", "-r", str(base), str(out_copy)],
    }
    outputs = {"converter": out_conv, "peft": out_peft, "copy": out_copy}

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
    for name, cmd in commands.items():
        shutil.rmtree(outputs[name], ignore_errors=True)
        r = measure(name, cmd, logs / f"{name}.log", cold=cold)
        rss = r.peak_rss_mib
        print(
            f"  {name:9s} exit {r.rc}  {r.wall_s:6.1f} s (+{r.sync_s:.1f} s sync)  peak RSS {rss:6.0f} MiB", flush=True
        )
        if not r.ok:
            print(_tail(r.log), file=sys.stderr)
        runs.append(r)
    shutil.rmtree(out_copy, ignore_errors=True)
    if not all(r.ok for r in runs):
        print("a run failed (logs above); not comparing or recording", file=sys.stderr)
        return 1

    capped, cap_note = None, ""
    root = memory_cgroup_root()
    if args.no_caps:
        cap_note = "--no-caps"
    elif root is None:
        cap_note = "no writable cgroup v1 memory controller here (needs root and /sys/fs/cgroup/memory)"
        print(f"memory caps skipped: {cap_note}", flush=True)
    else:
        capped = []
        scratch = {"converter": work / "out-converter-capped", "peft": work / "out-peft-capped"}
        cap_cmds = {
            "converter": [*commands["converter"][:-2], str(scratch["converter"]), "--force"],
            "peft": [*commands["peft"][:-1], str(scratch["peft"])],
        }
        for cap in CAPS_MIB:
            for name, cmd in cap_cmds.items():
                shutil.rmtree(scratch[name], ignore_errors=True)
                group, has_memsw = make_cgroup(root, f"merge-bench-{os.getpid()}-{name}-{cap}", cap)
                cap_note = f"cgroup {root}/merge-bench-*" + (", memsw set" if has_memsw else ", no memsw file")
                try:
                    r = measure(name, cmd, logs / f"{name}-cap{cap}.log", cold=cold, cgroup=group)
                    r.cap_mib, r.oom_kills = cap, oom_kills(group)
                    r.cgroup_peak_mib = int((group / "memory.max_usage_in_bytes").read_text()) / MiB
                finally:
                    remove_cgroup(group)
                    shutil.rmtree(scratch[name], ignore_errors=True)
                print(
                    f"  {name:9s} under {cap} MiB: {r.status}, {r.wall_s:.1f} s, peak RSS {r.peak_rss_mib:.0f} MiB",
                    flush=True,
                )
                capped.append(r)

    print("comparing outputs tensor by tensor ...", flush=True)
    cmp = compare_outputs(out_conv, out_peft, base, adapter)
    shutil.rmtree(out_conv, ignore_errors=True)
    shutil.rmtree(out_peft, ignore_errors=True)

    shown_argv = ["python", "bench/merge_bench.py", *(argv if argv is not None else sys.argv[1:])]
    section = render(info, shown_argv, shape, params, cold, runs, capped, cap_note, cmp)
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
