"""Benchmark the default `converter merge` (merge + verification) against PEFT's plain merge, side by side.

Why: the default command must not be slower or hungrier than the tool it replaces. PEFT's `merge_and_unload`
(no check at all) and `converter merge` (quick verification, the default; `--verify full` once per round) run
alternately in whole subprocesses on the synthetic Llama of merge_bench.py (same inputs, cached), so a noisy,
shared machine affects all of them alike; the 1-minute load average is reported with every run.
`--baseline SRC` adds the default `converter merge` of another source tree (e.g. the code before a change).

    python bench/verify_bench.py [--workdir DIR] [--small] [--rounds N] [--baseline SRC] [--no-record]

Results are appended to bench/RESULTS.md (not for --small).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_bench import (  # noqa: E402
    BENCH_DIR,
    FULL,
    PEFT_SCRIPT,
    SMALL,
    _param_count,
    build_inputs,
    drop_caches,
    machine_info,
    measure,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=BENCH_DIR / "work", help="cache and outputs (bench/work)")
    parser.add_argument("--small", action="store_true", help="a much smaller model: a quick smoke run")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (the best of each is reported)")
    parser.add_argument("--baseline", type=Path, help="another converter source tree to run the default merge of")
    parser.add_argument("--no-full", action="store_true", help="leave out the `--verify full` run")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    parser.add_argument("--results", type=Path, default=BENCH_DIR / "RESULTS.md", help="where results are appended")
    args = parser.parse_args(argv)
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
        "full": ("`converter merge --verify full`", merge(work / "out-full", "--verify", "full")),
    }
    if args.no_full:
        del tools["full"]
    if args.baseline:
        tools["baseline"] = (f"`converter merge` of {args.baseline.name} (before)", merge(work / "out-baseline"))
    cold = drop_caches()
    runs: dict[str, list] = {name: [] for name in tools}
    for i in range(args.rounds):
        for name, (_label, cmd) in tools.items():
            env_path = str(args.baseline.resolve()) if name == "baseline" else str(Path(__file__).resolve().parents[1])
            os.environ["PYTHONPATH"] = env_path  # the measured subprocess imports this tree's converter
            r = measure(f"{name}-{i}", cmd, logs / f"{name}-{i}.log", cold)
            if not r.ok:
                print(f"{name} failed: see {r.log}", file=sys.stderr)
                return 1
            runs[name].append(r)
    reports = {n: json.loads((work / f"out-{n}" / "verification.json").read_text()) for n in tools if n != "peft"}
    best = {n: min(rs, key=lambda r: r.wall_s) for n, rs in runs.items()}
    peft = best["peft"]
    rows = []
    for name, (label, _cmd) in tools.items():
        b, rep = best[name], reports.get(name)
        verdict = f" — {rep['verdict']}, verification {rep['seconds']:.1f} s" if rep else ""
        walls = " / ".join(f"{r.wall_s:.1f}" for r in runs[name])
        loads = " / ".join(f"{r.load1:.1f}" for r in runs[name])
        rows.append(
            f"| {label}{verdict} | {b.wall_s:.1f} s ({walls}) | {b.cpu_s:.1f} s | {b.peak_rss_mib:.0f} MiB | "
            f"{b.wall_s / peft.wall_s:.2f}x / {b.peak_rss_mib / peft.peak_rss_mib:.2f}x | {loads} |"
        )
    phases = reports["quick"]["phase_seconds"]
    text = "\n".join(
        [
            f"\n## Default merge + verification vs PEFT's plain merge: {info['date']} ({_param_count(base)}, "
            f"{'cold' if cold else 'warm'} cache, {args.rounds} alternating rounds)",
            "",
            f"Machine: {info['cores']} cores, {info['ram']}, {info['cpu']}; converter {info['source']}. Best wall "
            "time of the rounds (all rounds in brackets); CPU and peak RSS of that run; load average (1 min) at the "
            "start of each run: the machine is shared, so compare runs of the same round.",
            "",
            "| run | wall | CPU | peak RSS | vs PEFT (time / memory) | load avg |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            "Quick verification phases (s): " + ", ".join(f"{k} {v}" for k, v in phases.items()) + ".",
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
