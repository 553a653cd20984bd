"""Benchmark: a PEFT target_parameters LoRA on fused MoE experts merged into a Qwen3-MoE, `converter merge` vs PEFT.

Why: PEFT's way (load the base, wrap, `merge_and_unload`, `save_pretrained`) holds the whole model in memory;
converter streams one tensor at a time, on a base stored per expert (each expert's gate/up/down a tensor, as
`save_pretrained` writes it) or fused (E, out, in). Each run is its own subprocess under GNU time (peak RSS).

    python bench/moe_bench.py [--workdir DIR] [--experts 64] [--hidden 512] [--layers 4] [--no-record]

(a) converter merge --base <per-expert base> --adapter <lora> --no-verify
(b) the same onto the fused base
(c) PEFT: from_pretrained + PeftModel.from_pretrained + merge_and_unload + save_pretrained (per-expert names)
(a) and (c) are compared tensor by tensor (float32 math both; the largest difference is reported).
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

BUILD = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    work, experts, hidden, layers = Path(sys.argv[1]), *map(int, sys.argv[2:5])
    config = Qwen3MoeConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2, num_experts=experts, num_experts_per_tok=4, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(work / "per_expert")
    model.save_pretrained(work / "fused", save_original_format=False)
    targets = dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, **targets))
    model.save_pretrained(work / "lora")
    """
)

PEFT = textwrap.dedent(
    """
    import sys
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base, adapter, out = sys.argv[1:4]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    model.merge_and_unload().save_pretrained(out)
    """
)

COMPARE = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from safetensors.torch import load_file
    def read(p):
        return {k: v for f in sorted(Path(p).glob("*.safetensors")) for k, v in load_file(f).items()}
    a, b = read(sys.argv[1]), read(sys.argv[2])
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    print(max((a[k].float() - b[k].float()).abs().max().item() for k in a))
    """
)


def measure(cmd: list[str], log: Path) -> tuple[float, int]:
    stat = log.with_suffix(".rusage")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(["/usr/bin/time", "-f", "maxrss_kib=%M", "-o", str(stat), *cmd], stdout=f, stderr=f)
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"{cmd[:4]} failed ({rc}); see {log}")
    return wall, int(stat.read_text().split("maxrss_kib=")[1].split()[0]) // 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/moe-bench")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    py = sys.executable
    if not (work / "lora").is_dir():
        subprocess.run([py, "-c", BUILD, str(work), str(args.experts), str(args.hidden), str(args.layers)], check=True,
                       env=env, capture_output=True)  # fmt: skip
    size = sum(f.stat().st_size for f in (work / "per_expert").glob("*.safetensors"))
    rows = []
    for name, cmd, out in (
        ("`converter merge`, base per expert", [py, "-m", "converter", "merge", "--base", str(work / "per_expert"),
         "--adapter", str(work / "lora"), "--out", str(work / "ours"), "--no-verify", "--force"], "ours"),
        ("`converter merge`, base fused (E, out, in)", [py, "-m", "converter", "merge", "--base", str(work / "fused"),
         "--adapter", str(work / "lora"), "--out", str(work / "ours_fused"), "--no-verify", "--force"], "ours_fused"),
        ("PEFT `merge_and_unload` + `save_pretrained`", [py, "-c", PEFT, str(work / "per_expert"), str(work / "lora"),
         str(work / "peft")], "peft"),
    ):  # fmt: skip
        wall, peak = measure(cmd, work / f"{out}.log")
        rows.append((name, wall, peak))
        print(f"{name}: {wall:.1f} s, {peak} MiB", flush=True)
    diff = subprocess.run([py, "-c", COMPARE, str(work / "ours"), str(work / "peft")], env=env, check=True,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    print(f"largest difference, converter vs PEFT (per-expert outputs): {diff}")
    if args.no_record:
        return
    load = os.getloadavg()[0]
    peft_wall, peft_peak = rows[-1][1:]
    lines = [
        f"\n## MoE target_parameters LoRA merge vs PEFT: {time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime())}"
        f" (Qwen3-MoE, {args.experts} experts x {args.layers} layers, hidden {args.hidden}, "
        f"{size / 2**20:.0f} MiB float32, LoRA r=8 on both expert tensors + q_proj)\n",
        f"Machine: {os.cpu_count()} cores, load average {load:.1f} at the end. `python bench/moe_bench.py`.\n",
        "| run | wall | peak RSS | vs PEFT (time / memory) |",
        "|---|---|---|---|",
        *[f"| {n} | {w:.1f} s | {p} MiB | {w / peft_wall:.2f}x / {p / peft_peak:.2f}x |" for n, w, p in rows],
        f"\nLargest difference between converter's and PEFT's merged tensors: {diff} (float32; one rounding each).\n",
    ]
    with open(ROOT / "bench/RESULTS.md", "a") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
