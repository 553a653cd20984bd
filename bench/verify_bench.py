"""Benchmark the default `converter merge` (merge + verification) against PEFT's plain merge, side by side.

Why: the default command must not be slower or hungrier than the tool it replaces. PEFT's `merge_and_unload`
(no check at all) and `converter merge` (quick verification, the default; `--verify full` once per round) run
alternately in whole subprocesses on the synthetic Llama of merge_bench.py (same inputs, cached), so a noisy,
shared machine affects all of them alike; the 1-minute load average is reported with every run.
`--baseline SRC` adds the default `converter merge` of another source tree (e.g. the code before a change).
The tensor proof is also measured alone (`converter verify --proof tensors` on the default merge's output, in its
own process: imports, referee, every tensor read and checked), so its own time and peak memory are reported, and
so is the merge alone (`--no-verify`), whose CPU the proof's should not exceed. Each run's wall, CPU and peak are
the medians over the rounds, with their ratios to PEFT's; the bold line states the target.

`--big` instead builds a Llama-3-8B-shaped synthetic model (8.03 B parameters, bf16, 16 GB) and a rank-16
all-linear LoRA straight to safetensors from its shapes alone (no model object: the base's bytes are one block of
random bf16 values repeated, as merge_bench.py's larger-than-RAM model), runs the default `converter merge` on it
once, then the tensor proof alone, checks that verification ran in memory (no disk offloading) and passed, and
removes the ~32 GB of files afterwards (`--keep` leaves them). It needs ~40 GB of free disk and ~12 GiB of
available memory; on a shared machine run it under a lock file the machine's users share:
`flock BENCH.lock python bench/verify_bench.py --big`. `--big --shape tiny` runs the same steps on a model of a
few megabytes: a smoke run of the script, not a measurement.

    python bench/verify_bench.py [--workdir DIR] [--small | --big [--shape 8b|tiny] [--keep]] [--rounds N]
                                 [--baseline SRC] [--no-full] [--no-record]

Results are appended to bench/RESULTS.md (not for --small).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_bench import (  # noqa: E402
    BENCH_DIR,
    FULL,
    LORA_ALPHA,
    LORA_RANK,
    PEFT_SCRIPT,
    SMALL,
    Shape,
    _param_count,
    build_inputs,
    drop_caches,
    machine_info,
    measure,
)

# Llama-3-8B's shapes (untied head): 8.03 B parameters, 16 GB in bf16.
BIG = Shape(hidden=4096, layers=32, intermediate=14336, vocab=128256, heads=32, kv_heads=8)
BIG_SHAPES = {"8b": BIG, "tiny": Shape(hidden=128, layers=2, intermediate=344, vocab=1024, heads=4, kv_heads=2)}
BIG_MIN_AVAILABLE = 12 * 2**30  # verification's working set is ~6 GiB (two blocks + the head in float32, ...)
BIG_MIN_DISK = 40 * 10**9  # base 16 GB + merged 16 GB + slack
SHARD_BYTES = 4 * 10**9
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=BENCH_DIR / "work", help="cache and outputs (bench/work)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", help="a much smaller model: a quick smoke run")
    size.add_argument("--big", action="store_true", help="a Llama-3-8B-shaped model: default merge once, in memory?")
    parser.add_argument("--shape", choices=sorted(BIG_SHAPES), default="8b", help="--big: the model (tiny: smoke run)")
    parser.add_argument("--keep", action="store_true", help="--big: keep the 8B model's files (~32 GB) afterwards")
    parser.add_argument("--build-only", type=Path, help=argparse.SUPPRESS)  # internal: --big's builder process
    parser.add_argument("--build-shape", default=json.dumps(BIG.__dict__), help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (the best of each is reported)")
    parser.add_argument("--baseline", type=Path, help="another converter source tree to run the default merge of")
    parser.add_argument("--no-full", action="store_true", help="leave out the `--verify full` run")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    parser.add_argument("--results", type=Path, default=BENCH_DIR / "RESULTS.md", help="where results are appended")
    args = parser.parse_args(argv)
    if args.build_only:
        build_safetensors_llama(Shape(**json.loads(args.build_shape)), args.build_only)
        return 0
    if args.big:
        return run_big(args, BIG_SHAPES[args.shape])
    shape = SMALL if args.small else FULL
    work = args.workdir.resolve() / ("small" if args.small else "full")
    logs = work / "logs"
    info = machine_info()
    base, adapter = build_inputs(shape, work / "inputs")
    logs.mkdir(parents=True, exist_ok=True)
    converter = [sys.executable, "-P", "-m", "converter"]  # -P: PYTHONPATH picks the tree, not the working dir

    def merge(out: Path, *extra: str) -> list[str]:
        return [
            *converter,
            "merge",
            "--base",
            str(base),
            "--adapter",
            str(adapter),
            "--out",
            str(out),
            "--force",
            *extra,
        ]

    tools = {
        "peft": (
            "PEFT `merge_and_unload` + save (no check)",
            [sys.executable, "-c", PEFT_SCRIPT, str(base), str(adapter), str(work / "out-peft")],
        ),
        "quick": ("`converter merge` (default: merge + quick verification)", merge(work / "out-quick")),
        "merge": ("`converter merge --no-verify` (the merge alone)", merge(work / "out-merge", "--no-verify")),
        "proof": (
            "the tensor proof alone (`converter verify --proof tensors`)",
            [*converter, "verify", str(work / "out-quick"), "--proof", "tensors", "--report", str(work / "proof.json")],
        ),
        "full": ("`converter merge --verify full`", merge(work / "out-full", "--verify", "full")),
    }
    if args.no_full:
        del tools["full"]
    if args.baseline:
        tools["baseline"] = (f"`converter merge` of {args.baseline.name} (before)", merge(work / "out-baseline"))
    cold = drop_caches()
    runs: dict[str, list] = {name: [] for name in tools}
    reports: dict[str, dict] = {}  # the last round's report of each verifying run
    proof_cpu: list[float | None] = []  # the default run's tensor-proof CPU seconds, round by round
    for i in range(args.rounds):
        for name, (_label, cmd) in tools.items():
            env_path = str(args.baseline.resolve()) if name == "baseline" else str(Path(__file__).resolve().parents[1])
            os.environ["PYTHONPATH"] = env_path  # the measured subprocess imports this tree's converter
            r = measure(f"{name}-{i}", cmd, logs / f"{name}-{i}.log", cold)
            if not r.ok:
                print(f"{name} failed: see {r.log}", file=sys.stderr)
                return 1
            runs[name].append(r)
            written = work / "proof.json" if name == "proof" else work / f"out-{name}" / "verification.json"
            if name not in ("peft", "merge"):  # read now: the proof-only run rewrites out-quick's report
                reports[name] = json.loads(written.read_text())
            if name == "quick":
                proof_cpu.append((reports[name].get("phase_cpu_seconds") or {}).get("tensor proof"))
    mid = {n: _median_run(rs) for n, rs in runs.items()}
    rows = []
    for name, (label, _cmd) in tools.items():
        m, rep = mid[name], reports.get(name)
        verdict = f" — {rep['verdict']}, verification {rep['seconds']:.1f} s" if rep else ""
        walls = " / ".join(f"{r.wall_s:.1f}" for r in runs[name])
        cpus = " / ".join(f"{r.cpu_s:.1f}" for r in runs[name])
        loads = " / ".join(f"{r.load1:.1f}" for r in runs[name])
        w, c, p = _round_ratios(runs[name], runs["peft"])
        rows.append(
            f"| {label}{verdict} | {m.wall_s:.1f} s ({walls}) | {m.cpu_s:.1f} s ({cpus}) | {m.peak_rss_mib:.0f} MiB | "
            f"{w:.2f}x / {c:.2f}x / {p:.2f}x | {loads} |"
        )
    quick = reports["quick"]
    proof = quick.get("tensors") or {}
    text = "\n".join(
        [
            f"\n## Default merge + verification vs PEFT's plain merge: {info['date']} ({_param_count(base)}, "
            f"{'cold' if cold else 'warm'} cache, {args.rounds} alternating rounds)",
            "",
            f"Command: `python bench/verify_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}`. "
            f"Machine: {info['cores']} cores, {info['ram']}, {info['cpu']}; converter {info['source']}. Median of the "
            "rounds (each round in brackets) of wall time, CPU time (user + system) and peak RSS; load average (1 "
            "min) at the start of each run: the machine may be shared, so compare runs of the same round, and CPU "
            "time before wall time.",
            "",
            "| run | wall | CPU | peak RSS | vs PEFT, same round (wall / CPU / peak) | load avg |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            _ratio_line(runs["quick"], runs["peft"]),
            "",
            _phases_line("Quick verification phases", quick),
            "",
            _proof_line(proof),
            "",
            _proof_alone_line(reports["proof"].get("tensors") or {}, mid["proof"]),
            "",
            _proof_vs_merge_line(proof_cpu, runs["merge"]),
            "",
        ]
    )
    print(text)
    if not args.small and not args.no_record:
        with open(args.results, "a") as f:
            f.write(text)
    return 0


def _median_run(runs: list):
    """The run of median wall time (the lower middle one of an even count), its CPU and peak with it."""
    ordered = sorted(runs, key=lambda r: r.wall_s)
    return ordered[(len(ordered) - 1) // 2]


def _phases_line(title: str, report: dict) -> str:
    """A report's verification phases: wall seconds, and the process's CPU seconds in each (when recorded)."""
    cpu = report.get("phase_cpu_seconds") or {}
    parts = [f"{k} {v}" + (f" ({cpu[k]})" if k in cpu else "") for k, v in report["phase_seconds"].items()]
    return f"{title}, wall s (CPU s): " + ", ".join(parts) + "."


def _round_ratios(runs: list, peft: list) -> tuple[float, float, float]:
    """Median over the rounds of each run's wall, CPU and peak over PEFT's run of the same round: runs of one round
    share the machine's conditions, so a ratio never pairs a quiet round with a busy one."""
    import statistics

    pairs = list(zip(runs, peft, strict=True))
    return tuple(  # type: ignore[return-value]
        statistics.median(getattr(r, key) / getattr(p, key) for r, p in pairs)
        for key in ("wall_s", "cpu_s", "peak_rss_mib")
    )


def _ratio_line(converter: list, peft: list) -> str:
    """The target in one line: the default `converter merge` over PEFT's plain merge (below 1: converter is cheaper),
    the median of the per-round ratios."""
    wall, cpu, peak = _round_ratios(converter, peft)
    return (
        f"**Default `converter merge` / PEFT's plain merge (median of the rounds' ratios): wall {wall:.2f}x, "
        f"CPU {cpu:.2f}x, peak RSS {peak:.2f}x** (the target: all three at most 1)."
    )


def _proof_vs_merge_line(proof_cpu: list[float | None], merges: list) -> str:
    """The tensor proof's CPU in the default run (referee built, every tensor read and checked) against the whole
    `--no-verify` merge process's (start, imports, merge) of the same round, the median over the rounds: the proof
    should cost no more than the merge it checks."""
    import statistics

    if None in proof_cpu:
        return "The tensor proof's CPU time was not recorded."
    ratio = statistics.median(p / m.cpu_s for p, m in zip(proof_cpu, merges, strict=True))
    proofs = " / ".join(f"{p:.1f}" for p in proof_cpu)
    merged = " / ".join(f"{m.cpu_s:.1f}" for m in merges)
    return (
        f"**Tensor proof / merge, CPU: {ratio:.2f}x** (median of the rounds' ratios; the default run's tensor proof "
        f"phase {proofs} s against {merged} s for the whole `--no-verify` merge process, round by round)."
    )


def _proof_line(proof: dict) -> str:
    """What the tensor proof checked, from a report's "tensors" section."""
    if not proof:
        return "The tensor proof did not run."
    worst = (proof.get("worst") or {}).get("ratio", 0)
    return (
        f"Tensor proof (referee {proof['referee']['name']}): {proof['changed']} changed tensors "
        f"({proof['elements']:,} elements, {proof['inexact']:,} not exactly the rounded expectation, worst "
        f"{float(worst):.3g}x the rounding bound) and {proof['untouched']} untouched ones, in {proof['seconds']} s "
        "of checking after the referee was built."
    )


def _proof_alone_line(proof: dict, run) -> str:
    """The tensor proof run by itself: the whole process (imports, referee, every tensor) and the checking."""
    if not proof:
        return "The tensor proof alone did not run."
    return (
        f"The tensor proof alone: {run.wall_s:.1f} s and {run.peak_rss_mib:.0f} MiB peak for the whole process "
        f"(imports, the referee built without weights, every tensor read and checked), of which {proof['seconds']} s "
        f"checking {proof['tensors']} tensors."
    )


# ------------------------------------------------------------------------------------------------------ --big


def llama_tensors(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Llama with these shapes, in the order transformers saves them."""
    kv = shape.hidden // shape.heads * shape.kv_heads
    out = [("model.embed_tokens.weight", (shape.vocab, shape.hidden))]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (shape.hidden,)),
            (p + "mlp.down_proj.weight", (shape.hidden, shape.intermediate)),
            (p + "mlp.gate_proj.weight", (shape.intermediate, shape.hidden)),
            (p + "mlp.up_proj.weight", (shape.intermediate, shape.hidden)),
            (p + "post_attention_layernorm.weight", (shape.hidden,)),
            (p + "self_attn.k_proj.weight", (kv, shape.hidden)),
            (p + "self_attn.o_proj.weight", (shape.hidden, shape.hidden)),
            (p + "self_attn.q_proj.weight", (shape.hidden, shape.hidden)),
            (p + "self_attn.v_proj.weight", (kv, shape.hidden)),
        ]
    return [*out, ("model.norm.weight", (shape.hidden,)), ("lm_head.weight", (shape.vocab, shape.hidden))]


def _write_file(path: Path, tensors: list[tuple[str, tuple[int, ...], str]], fill=None, block=None) -> None:
    """One safetensors file written front to back: header first (all shapes are known), then each tensor as
    `fill(name, out_tensor)` produces it, in pieces, or as the bytes of `block(name)` repeated (no arithmetic:
    16 GB of base in the time it takes to write them); nothing larger than one piece is held."""
    import math

    import torch

    from converter.io.dtypes import ITEMSIZE, ST_TO_TORCH
    from converter.io.safetensors_header import encode_header, entry

    entries, offset = {}, 0
    for name, shape, dtype in tensors:
        size = math.prod(shape) * ITEMSIZE[dtype]
        entries[name] = entry(dtype, shape, offset, offset + size)
        offset += size
    with open(path, "wb") as f:
        f.write(encode_header(entries, {"format": "pt"}))
        for name, shape, dtype in tensors:
            if block is not None:
                _repeat(f, block(name), math.prod(shape) * ITEMSIZE[dtype])
                continue
            rows = max(1, (1 << 25) // max(1, math.prod(shape[1:])))  # ~32 M elements a piece
            for start in range(0, shape[0], rows):
                piece = torch.empty((min(rows, shape[0] - start), *shape[1:]), dtype=torch.float32)
                fill(name, piece)
                f.write(piece.to(ST_TO_TORCH[dtype]).view(torch.uint8).numpy())
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # 16 GB of page cache helps nobody


def _repeat(f, block: memoryview, nbytes: int) -> None:
    while nbytes:
        n = min(nbytes, len(block))
        f.write(block[:n])
        nbytes -= n


def _random_bf16_block(norms: bool = False) -> memoryview:
    """32 M random finite bf16 values (64 MiB), as bytes: N(0, 0.02), or N(1, 0.1) for norm weights."""
    import numpy as np

    rng = np.random.default_rng(1 if norms else 0)
    values = rng.standard_normal(32 * 2**20, dtype=np.float32) * (0.1 if norms else 0.02) + (1.0 if norms else 0.0)
    return memoryview((values.view(np.uint32) >> 16).astype(np.uint16)).cast("B")


def build_safetensors_llama(shape: Shape, folder: Path) -> None:
    """A random bf16 Llama base (HF layout: config, shards, index) and a non-zero rank-16 all-linear PEFT LoRA,
    written without a model object: transformers would need the whole model (16 GB for 8 B) in memory."""
    import torch

    torch.manual_seed(0)
    base, adapter = folder / "base", folder / "adapter"
    base.mkdir(parents=True)
    adapter.mkdir()

    weights, norm_block = _random_bf16_block(), _random_bf16_block(norms=True)

    shards, current, size = [], [], 0
    for name, dims in llama_tensors(shape):
        nbytes = 2 * int(torch.tensor(dims).prod())
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((name, dims, "BF16"))
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_file(base / file, shard, block=lambda n: norm_block if n.endswith("norm.weight") else weights)
        weight_map.update({name: file for name, _, _ in shard})
        print(f"  {file} written", flush=True)
    (base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (base / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": shape.hidden,
                "intermediate_size": shape.intermediate,
                "num_hidden_layers": shape.layers,
                "num_attention_heads": shape.heads,
                "num_key_value_heads": shape.kv_heads,
                "vocab_size": shape.vocab,
                "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "dtype": "bfloat16",
            },
            indent=2,
        )
    )
    kv = shape.hidden // shape.heads * shape.kv_heads
    sizes = {
        "q_proj": (shape.hidden, shape.hidden),
        "k_proj": (shape.hidden, kv),
        "v_proj": (shape.hidden, kv),
        "o_proj": (shape.hidden, shape.hidden),
        "gate_proj": (shape.hidden, shape.intermediate),
        "up_proj": (shape.hidden, shape.intermediate),
        "down_proj": (shape.intermediate, shape.hidden),
    }
    lora = []
    for i in range(shape.layers):
        for module in LINEARS:
            part = "self_attn" if module in LINEARS[:4] else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{module}"
            fan_in, fan_out = sizes[module]
            lora += [
                (f"{key}.lora_A.weight", (LORA_RANK, fan_in), "F32"),
                (f"{key}.lora_B.weight", (fan_out, LORA_RANK), "F32"),
            ]
    _write_file(adapter / "adapter_model.safetensors", lora, lambda _name, piece: piece.normal_(0.0, 0.02))
    (adapter / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": LORA_RANK,
                "lora_alpha": LORA_ALPHA,
                "target_modules": list(LINEARS),
                "lora_dropout": 0.0,
                "bias": "none",
                "fan_in_fan_out": False,
                "use_rslora": False,
                "use_dora": False,
                "inference_mode": True,
            },
            indent=2,
        )
    )


def run_big(args, shape: Shape) -> int:
    """The default `converter merge` of an 8B-shaped model, once, and the tensor proof alone: does verification stay
    in memory (no offload), and what does the proof cost by itself? (`--shape tiny`: the same steps, a smoke run.)"""
    sys.path.insert(0, str(BENCH_DIR.parent))
    from converter.io.memory import available_memory

    work = args.workdir.resolve() / "big"
    smoke = shape != BIG
    args.workdir.mkdir(parents=True, exist_ok=True)
    available, disk = available_memory(), shutil.disk_usage(args.workdir.resolve()).free
    if not smoke and (available < BIG_MIN_AVAILABLE or disk < BIG_MIN_DISK):
        print(
            f"--big needs {BIG_MIN_AVAILABLE / 2**30:.0f} GiB of available memory and {BIG_MIN_DISK / 1e9:.0f} GB of "
            f"free disk; this machine has {available / 2**30:.1f} GiB and {disk / 1e9:.0f} GB now",
            file=sys.stderr,
        )
        return 2
    info = machine_info()
    shutil.rmtree(work, ignore_errors=True)
    logs = work / "logs"
    try:
        t0 = time.perf_counter()
        print(f"building a {'tiny' if smoke else '8B'}-shaped model in {work / 'inputs'} ...", flush=True)
        env = {**os.environ, "PYTHONPATH": str(BENCH_DIR.parent)}
        build = [
            sys.executable,
            __file__,
            "--build-only",
            str(work / "inputs"),
            "--build-shape",
            json.dumps(shape.__dict__),
        ]
        subprocess.run(build, check=True, env=env)
        built_s = time.perf_counter() - t0
        logs.mkdir(parents=True)
        base, adapter, out = work / "inputs" / "base", work / "inputs" / "adapter", work / "out"
        os.environ["PYTHONPATH"] = str(BENCH_DIR.parent)
        cmd = [sys.executable, "-P", "-m", "converter", "merge", "--base", str(base), "--adapter", str(adapter)]
        r = measure("big", [*cmd, "--out", str(out), "--force"], logs / "big.log", drop_caches())
        if not r.ok:
            print((logs / "big.log").read_text()[-3000:], file=sys.stderr)
            return 1
        rep = json.loads((out / "verification.json").read_text())
        proof_cmd = [sys.executable, "-P", "-m", "converter", "verify", str(out), "--proof", "tensors", "--report",
                     str(work / "proof.json")]  # fmt: skip
        p = measure("big-proof", proof_cmd, logs / "big-proof.log", drop_caches())
        if not p.ok:
            print((logs / "big-proof.log").read_text()[-3000:], file=sys.stderr)
            return 1
        text = "\n".join(
            [
                f"\n## Default merge + verification of {'a tiny' if smoke else 'an 8B'}-shaped model: {info['date']} "
                f"(verify_bench.py --big{' --shape tiny: a smoke run, not a measurement' if smoke else ''})",
                "",
                f"Machine: {info['cores']} cores, {info['ram']}, {info['cpu']}; converter {info['source']}. Synthetic "
                f"Llama{'' if smoke else '-3-8B'} shapes ({_param_count(base)}), rank-{LORA_RANK} all-linear LoRA; "
                "built on disk in "
                f"{built_s:.0f} s and removed afterwards. Load average at the start: {r.load1:.1f}.",
                "",
                "| run | wall | CPU | peak RSS | verdict | offloaded | verification |",
                "|---|---|---|---|---|---|---|",
                f"| `converter merge` (default: merge + quick verification) | {r.wall_s:.1f} s | {r.cpu_s:.1f} s | "
                f"{r.peak_rss_mib:.0f} MiB | {rep['verdict']} | {rep['offloaded']} | {rep['seconds']:.1f} s |",
                f"| the tensor proof alone (`converter verify --proof tensors`) | {p.wall_s:.1f} s | {p.cpu_s:.1f} s | "
                f"{p.peak_rss_mib:.0f} MiB | | | |",
                "",
                _phases_line("Verification phases", rep),
                "",
                _proof_line(rep.get("tensors") or {}),
                "",
                _proof_alone_line(json.loads((work / "proof.json").read_text()).get("tensors") or {}, p),
                "",
            ]
        )
        print(text)
        if not args.no_record and not smoke:
            with open(args.results, "a") as f:
                f.write(text)
        return 0 if rep["verdict"] == "pass" and not rep["offloaded"] else 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
