"""Benchmark: `converter batch` throughput (jobs/min) on a local Ray cluster of 1 vs 2 workers (CPUs).

Why: a batch is many independent jobs; what Ray buys is running them side by side. This runs the same batch of
kohya text-encoder LoRA conversions (`convert --to diffusers --push-pr`, each a PR on its own repo of the local Hub
server) once with `--num-cpus 1` and once with `--num-cpus 2`, each on fresh repos, through the real CLI (which
starts its own local Ray cluster: the laptop path). Jobs are tiny, so the numbers are mostly per-job overhead
(a Python process importing torch, Hub round trips), which is what dominates a batch of small LoRAs.

    python bench/batch_bench.py [--jobs 12] [--workdir DIR] [--no-record]

Throughput is counted from the first submitted job to the last result (the report's "This run" line); the wall
time of the whole command (Ray's start and stop included) is given beside it.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

TOKEN = "hf_fake_bench_0123456789"


def seed_repos(hub, root: Path, namespace: str, n: int) -> list[str]:
    from diffusion_helpers import TE_TARGETS, kohya_lora, kohya_modules, save, tiny_clip

    clip = tiny_clip(24)
    if not (root / "clip").exists():
        clip.save_pretrained(root / "clip")
    modules = kohya_modules(clip, "lora_te", TE_TARGETS)
    repos = []
    for i in range(n):
        repo = f"{namespace}/style-{i}"
        save(kohya_lora(modules, rank=2, seed=i), root / repo / "style.safetensors")
        hub.seed_folder(repo, root / repo)
        repos.append(repo)
    return repos


def run(hub, root: Path, workers: int, n: int) -> dict:
    import yaml

    from converter.testing.hub import client_env

    repos = seed_repos(hub, root, f"w{workers}", n)
    jobs = root / f"jobs-{workers}.yaml"
    jobs.write_text(yaml.safe_dump({
        "defaults": {"to": "diffusers", "base": str(root / "clip"), "component": "text_encoder"},
        "jobs": [{"convert": f"{r}/style.safetensors"} for r in repos],
    }))  # fmt: skip
    env = client_env(hub, TOKEN) | {"PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "converter", "batch", str(jobs), "--num-cpus", str(workers)],
                          env=env, capture_output=True, text=True, timeout=1800)  # fmt: skip
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"batch with {workers} worker(s) failed:\n{proc.stdout}\n{proc.stderr}")
    report = jobs.with_suffix(".report.md").read_text()
    m = re.search(r"This run: (\d+) jobs in ([0-9.]+) s \(([0-9.]+) jobs/min\)", report)
    assert m and int(m[1]) == n, report
    prs = sum(len(hub.repo(r).discussions) for r in repos)
    assert prs == n, f"{prs} PRs for {n} jobs"
    return {"workers": workers, "jobs": n, "seconds": float(m[2]), "per_min": float(m[3]), "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--workdir", default=str(BENCH_DIR / "work" / "batch"))
    ap.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from converter.testing.hub import HubServer

    root = Path(args.workdir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    load = os.getloadavg()[0]
    with HubServer(root / "hub") as hub:
        hub.add_user("w1", TOKEN, orgs=["w2"])
        results = [run(hub, root, w, args.jobs) for w in (1, 2)]
    lines = [
        f"## `converter batch` throughput, 1 vs 2 workers ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}. "
        f"{args.jobs} jobs, each `convert --to diffusers --push-pr` of a tiny kohya text-encoder LoRA to its own "
        "repo on the local Hub server; a local Ray cluster started by the CLI (`--num-cpus N`). "
        f"Command: `python bench/batch_bench.py`. Load average at the start: {load:.1f} (other work on the machine "
        "makes these numbers noisy).",
        "",
        "| workers | jobs | first submit → last result | jobs/min | whole command (Ray start/stop included) |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['workers']} | {r['jobs']} | {r['seconds']:.1f} s | {r['per_min']:.1f} | {r['wall']:.1f} s |"
              for r in results]  # fmt: skip
    speedup = results[1]["per_min"] / results[0]["per_min"]
    lines += ["", f"- 2 workers / 1 worker: {speedup:.2f}x jobs/min."]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_record:
        with open(BENCH_DIR / "RESULTS.md", "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
