"""Benchmark `converter verify` against loading the merged model once with transformers.

Why: verification loads the reference (base + adapters through PEFT) and the merged model one after the other,
never together, so it should cost about two model loads plus the forward passes, in time and in peak memory.
This measures that on the synthetic Llama of merge_bench.py (same inputs, cached), each in its own subprocess.

    python bench/verify_bench.py [--workdir DIR] [--small] [--no-record]

Both sides load in float32, the precision verification computes in when it fits. Results are appended to
bench/RESULTS.md (not for --small).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_bench import BENCH_DIR, FULL, SMALL, _param_count, build_inputs, drop_caches, machine_info, measure  # noqa: E402

LOAD_ONCE = textwrap.dedent(
    """
    import sys, time
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM
    t1 = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    print(f"import {t1 - t0:.1f}s, load {time.perf_counter() - t1:.1f}s", flush=True)
    """
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=BENCH_DIR / "work", help="cache and outputs (bench/work)")
    parser.add_argument("--small", action="store_true", help="a much smaller model: a quick smoke run")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    parser.add_argument("--results", type=Path, default=BENCH_DIR / "RESULTS.md", help="where results are appended")
    args = parser.parse_args(argv)
    shape = SMALL if args.small else FULL
    work = args.workdir.resolve() / ("small" if args.small else "full")
    logs = work / "logs"
    info = machine_info()
    base, adapter = build_inputs(shape, work / "inputs")
    logs.mkdir(parents=True, exist_ok=True)
    merged = work / "out-verify-bench"
    converter = [sys.executable, "-m", "converter"]
    merge = [*converter, "merge", "--base", str(base), "--adapter", str(adapter), "--out", str(merged), "--force"]
    subprocess.run([*merge, "--no-verify"], check=True, capture_output=True)
    cold = drop_caches()
    report_path = work / "verify-report.json"
    runs = {
        "load": measure("load", [sys.executable, "-c", LOAD_ONCE, str(merged)], logs / "load-once.log", cold),
        "verify": measure(
            "verify", [*converter, "verify", str(merged), "--report", str(report_path)], logs / "verify.log", cold
        ),
    }
    for name, r in runs.items():
        if not r.ok:
            print(f"{name} failed: see {r.log}", file=sys.stderr)
            return 1
    report = json.loads(report_path.read_text())
    load, verify = runs["load"], runs["verify"]
    phases = report["phase_seconds"]
    loads = phases["load reference"] + phases["load merged"]
    passes = phases["run reference and bare base"] + phases["run merged"]
    load_s = float(load.log.read_text().split("load ")[-1].split("s")[0])  # from_pretrained alone, no import
    text = "\n".join(
        [
            f"\n## Verification cost: {info['date']} ({_param_count(base)}, {'cold' if cold else 'warm'} cache)",
            "",
            f"Machine: {info['cores']} cores, {info['ram']}, {info['cpu']}; converter {info['source']}. "
            "`converter verify` (reference through PEFT, "
            f"bare base, merged model; {report['inputs']['count']} prompts, {report['inputs']['max_new_tokens']} "
            f"greedy tokens each; {report['compute_dtype']}) vs one `from_pretrained` of the merged model in float32.",
            "",
            "| run | wall | CPU | peak RSS |",
            "|---|---|---|---|",
            f"| load the merged model once | {load.wall_s:.1f} s | {load.cpu_s:.1f} s | {load.peak_rss_mib:.0f} MiB |",
            f"| `converter verify` (verdict: {report['verdict']}) | {verify.wall_s:.1f} s | {verify.cpu_s:.1f} s | "
            f"{verify.peak_rss_mib:.0f} MiB |",
            f"| ratio | {verify.wall_s / load.wall_s:.2f}x | {verify.cpu_s / max(load.cpu_s, 1e-9):.2f}x | "
            f"{verify.peak_rss_mib / load.peak_rss_mib:.2f}x |",
            "",
            f"Inside `converter verify`: the two loads (reference with PEFT, merged) took {loads:.1f} s, "
            f"{loads / load_s:.2f}x one `from_pretrained` ({load_s:.1f} s without the import); the forward passes "
            f"(reference, bare base, merged: logits, {report['inputs']['max_new_tokens']} greedy tokens per prompt, "
            f"perplexity, module probe) {passes:.1f} s; everything else (imports, tokenizer, metrics) "
            f"{verify.wall_s - loads - passes:.1f} s.",
            "",
        ]
    )
    print(text)
    if not args.small and not args.no_record:
        with open(args.results, "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
