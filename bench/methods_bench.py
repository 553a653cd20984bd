"""Extract and combine, streaming, next to the usual whole-model ways; time and peak RSS of each, one subprocess each.

(a) `converter extract` vs (b) a full-load extraction in the style of mergekit-extract-lora: both state dicts
loaded whole, then the same float32 SVD per linear weight (written here: mergekit itself is not installed).
(c) `converter combine --method svd` vs (d) PEFT: base model + both adapters loaded, `add_weighted_adapter(svd)`,
`save_pretrained`. Measured with merge_bench's launcher (GNU time: peak RSS of the one child). Timings on a shared
2-core machine are noisy: compare runs, not single numbers.

    python bench/methods_bench.py [--workdir bench/work/methods] [--no-record] [--only extract|combine]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from merge_bench import measure  # noqa: E402

HERE = Path(__file__).parent
RANK = 16

FULL_LOAD = r"""
import sys, torch
from safetensors.torch import load_file, save_file
base, tuned = load_file(sys.argv[1] + "/model.safetensors"), load_file(sys.argv[2] + "/model.safetensors")
out = {}
for k, t in tuned.items():
    if t.dim() != 2 or "embed" in k or torch.equal(t, base[k]):
        continue
    u, s, vh = torch.linalg.svd(t.float() - base[k].float(), full_matrices=False)
    root = s[:16].sqrt()
    m = "base_model.model." + k.removesuffix(".weight")
    out[m + ".lora_A.weight"] = (root[:, None] * vh[:16]).contiguous()
    out[m + ".lora_B.weight"] = (u[:, :16] * root).contiguous()
save_file(out, sys.argv[3])
"""

PEFT_COMBINE = r"""
import sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
model = PeftModel.from_pretrained(model, sys.argv[2], adapter_name="a")
model.load_adapter(sys.argv[3], adapter_name="b")
model.add_weighted_adapter(["a", "b"], [0.7, 0.3], "ab", combination_type="svd", svd_rank=16)
model.save_pretrained(sys.argv[4], selected_adapters=["ab"])
"""


def build(work: Path) -> tuple[Path, Path, Path, Path]:
    """A random bf16 Llama (hidden 768, 6 layers), a tuned copy (rank-16 change + noise on every linear weight),
    and two PEFT LoRAs (r=16, all-linear) on it. Cached in `work`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    base, tuned, a, b = (work / n for n in ("base", "tuned", "lora_a", "lora_b"))
    if (b / "adapter_config.json").is_file():
        return base, tuned, a, b
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8000, hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
                      num_attention_heads=12, num_key_value_heads=4, bos_token_id=1, eos_token_id=2)  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(base)
    sd = load_file(base / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    for k, t in sd.items():
        if t.dim() == 2 and "embed" not in k:
            low = torch.randn(t.shape[0], RANK, generator=g) @ torch.randn(RANK, t.shape[1], generator=g) * 1e-3
            sd[k] = (t.float() + low + 1e-4 * torch.randn(t.shape, generator=g)).to(t.dtype)
    tuned.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.suffix == ".json":
            (tuned / f.name).write_text(f.read_text())
    save_file(sd, tuned / "model.safetensors", metadata={"format": "pt"})
    for seed, folder in ((2, a), (3, b)):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        lora = LoraConfig(r=RANK, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
        get_peft_model(model, lora).save_pretrained(folder)
    return base, tuned, a, b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=str(HERE / "work" / "methods"))
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--only", choices=["extract", "combine"], help="run one pair only")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    base, tuned, a, b = build(work)
    py = sys.executable
    runs = [
        ("converter extract", [py, "-m", "converter", "extract", "--base", str(base), "--tuned", str(tuned), "--rank",
                               str(RANK), "--out", str(work / "x"), "--force"]),
        ("full-load extract", [py, "-c", FULL_LOAD, str(base), str(tuned), str(work / "full.safetensors")]),
        ("converter combine svd", [py, "-m", "converter", "combine", "--adapter", str(a), "--adapter", str(b),
                                   "--weight", "0.7", "--weight", "0.3", "--method", "svd", "--rank", str(RANK),
                                   "--out", str(work / "c"), "--force"]),
        ("PEFT add_weighted_adapter svd", [py, "-c", PEFT_COMBINE, str(base), str(a), str(b), str(work / "p")]),
    ]  # fmt: skip
    if args.only:
        runs = runs[:2] if args.only == "extract" else runs[2:]
    results = [measure(name, cmd, work / f"{i}.log", cold=False) for i, (name, cmd) in enumerate(runs)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## Run of methods_bench.py, {stamp} (commit {commit}, load {os.getloadavg()[0]:.1f})", "",
             "Llama hidden 768, 6 layers, bf16 (0.1 B parameters); extract at rank 16 from base + rank-16 change + "
             "noise; combine of two r=16 all-linear LoRAs by svd to rank 16.", "",
             "| run | exit | wall s | CPU s | peak RSS MiB | load before |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        lines.append(f"| {r.name} | {r.rc} | {r.wall_s:.1f} | {r.cpu_s:.1f} | {r.peak_rss_mib:.0f} | {r.load1:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_record:
        with open(HERE / "RESULTS.md", "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
