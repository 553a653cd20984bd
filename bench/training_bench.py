"""Benchmark: a verl FSDP checkpoint (W rank files) to a Hugging Face folder, `converter merge` vs what verl does.

Why: verl's model merger `torch.load`s every rank file at once, concatenates the shards and calls
`save_pretrained`, so its memory is the whole model (more, while shards and the full tensors coexist); converter
rebuilds one tensor at a time from byte ranges of the rank files. Both run in their own subprocess under GNU time
(peak RSS of that process), on a Llama of small layers saved by W gloo processes with FSDP2.

    python bench/training_bench.py [--workdir DIR] [--world 4] [--hidden 1536] [--layers 20] [--no-record]

(a) converter merge --base <actor> --out A --no-verify
(b) verl-style: torch.load(all ranks, weights_only=False) + cat of each DTensor's local shards + from_config +
    load_state_dict + save_pretrained
The outputs are compared tensor by tensor. Results are appended to bench/RESULTS.md unless --no-record.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

VERL_STYLE = textwrap.dedent(
    """
    import sys, json, torch
    import torch.distributed.tensor  # noqa: F401
    from pathlib import Path
    from transformers import AutoConfig, AutoModelForCausalLM
    actor, out, world = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    states = [torch.load(actor / f"model_world_size_{world}_rank_{r}.pt", weights_only=False) for r in range(world)]
    full = {}
    for key in states[0]:
        parts = [s[key] for s in states]
        if hasattr(parts[0], "_local_tensor"):
            p = parts[0].placements[0]
            locals_ = [t._local_tensor for t in parts]
            full[key] = torch.cat(locals_, dim=p.dim) if p.is_shard() else locals_[0]
        else:
            full[key] = torch.cat(parts, dim=0)
    del states
    config = AutoConfig.from_pretrained(actor / "huggingface")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(full, assign=True)
    model.save_pretrained(out)
    """
)


def measure(cmd: list[str], log: Path) -> tuple[float, int, int]:
    stat = log.with_suffix(".rusage")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(["/usr/bin/time", "-f", "maxrss_kib=%M", "-o", str(stat), *cmd], stdout=f, stderr=f)
    wall = time.perf_counter() - t0
    rss = int(stat.read_text().split("maxrss_kib=")[1].split()[0]) if stat.is_file() else 0
    return wall, rss // 1024, rc


def same_outputs(a: Path, b: Path) -> tuple[int, int]:
    from safetensors import safe_open

    def tensors(folder: Path):
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(f, "pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118 - safe_open is not iterable
        return out

    x, y = tensors(a), tensors(b)
    equal = sum(1 for k in x if k in y and x[k].dtype == y[k].dtype and x[k].equal(y[k]))
    return equal, len(y)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", default="/tmp/converter-training-bench")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--no-record", action="store_true")
    a = p.parse_args()
    work = Path(a.workdir)
    actor = work / "ckpt/plain/actor"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not actor.is_dir():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "converter.testing.training_checkpoints", str(work / "ckpt"),
                        "--world", str(a.world), "--hidden", str(a.hidden), "--layers", str(a.layers),
                        "--only-plain"], check=True, env=env)  # fmt: skip
        print(f"built the checkpoint in {time.perf_counter() - t0:.0f} s")
    size = sum(f.stat().st_size for f in actor.glob("model_world_size_*.pt"))
    results = {}
    for name, cmd in {
        "converter": [sys.executable, "-m", "converter", "merge", "--base", str(actor), "--out", str(work / "a"),
                      "--no-verify", "--force"],
        "verl-style": [sys.executable, "-c", VERL_STYLE, str(actor), str(work / "b"), str(a.world)],
    }.items():  # fmt: skip
        subprocess.run(["rm", "-rf", str(work / ("a" if name == "converter" else "b"))], check=True)
        results[name] = measure(cmd, work / f"{name}.log")
        wall, rss, rc = results[name]
        print(f"{name}: wall {wall:.1f} s, peak RSS {rss} MiB, rc {rc}", flush=True)
    equal, total = same_outputs(work / "a", work / "b")
    line = (
        f"| {a.world} | {size / 2**30:.2f} GiB | {results['converter'][0]:.1f} | {results['converter'][1]} | "
        f"{results['verl-style'][0]:.1f} | {results['verl-style'][1]} | {equal}/{total} |"
    )
    print(line)
    if not a.no_record:
        with open(ROOT / "bench/RESULTS.md", "a") as f:
            f.write(
                f"\n## Training checkpoint run of {time.strftime('%Y-%m-%d %H:%M')} (bench/training_bench.py)\n\n"
                f"Llama hidden {a.hidden}, {a.layers} layers, float32, FSDP2 over {a.world} gloo ranks. Load "
                f"{os.getloadavg()[0]:.1f}.\n\n"
                "| W | rank files | converter s | converter peak RSS MiB | verl-style s | verl-style peak RSS MiB | "
                "identical tensors |\n|---|---|---|---|---|---|---|\n" + line + "\n"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
