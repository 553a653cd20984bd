"""QLoRA on a real model: which merge base is closer to what the adapter was trained on, by how much, and at what
perplexity.

Why: a claim goes around that merging a QLoRA adapter onto the dequantized 4-bit weights costs ~20% perplexity on
ordinary models, while merging onto the original weights drifts from the training setting. This measures both on
SmolLM2-135M-Instruct (the test fixture, `make fixtures`): a LoRA is trained here on the NF4 4-bit base (QLoRA
proper, on the CPU), merged both ways by the converter, and every variant is scored on held-out text.

    python bench/qlora_bench.py [--steps N] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent / "scripts"))
from build_fixtures import cache_dir, is_complete  # noqa: E402

TRAIN = [
    "Question: What do bees make? Answer: Bees make honey from the nectar of flowers.",
    "Question: Where do penguins live? Answer: Most penguins live in the cold waters of the southern hemisphere.",
    "Question: What is ice? Answer: Ice is water that has frozen solid below zero degrees Celsius.",
    "Question: Why do leaves fall? Answer: Many trees drop their leaves in autumn to save water over winter.",
    "Question: What is a comet? Answer: A comet is a ball of ice and dust that grows a tail near the sun.",
    "Question: How do fish breathe? Answer: Fish take oxygen from the water with their gills.",
]
HELD_OUT = [
    "Question: What do cows eat? Answer: Cows mostly eat grass and hay, and they chew their food twice.",
    "Question: What is a volcano? Answer: A volcano is an opening in the ground where molten rock comes out.",
    "Question: Why is the sea salty? Answer: Rivers carry minerals from rocks into the sea, where salt builds up.",
    "Question: What is a desert? Answer: A desert is a place that gets very little rain during the year.",
]


def perplexity(model, tok, texts: list[str]) -> float:
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = tok(text, return_tensors="pt").input_ids
            loss = model(input_ids=ids, labels=ids).loss.item()
            total += loss * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return math.exp(total / count)


def nf4():
    """The QLoRA setting: NF4 with double quantization, computing in float32."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )


def train_qlora(base: Path, out: Path, steps: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, quantization_config=nf4())
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4)
    batch = tok(TRAIN, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    for step in range(steps):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"  step {step + 1}/{steps}: loss {loss.item():.3f}", flush=True)
    model.save_pretrained(out)
    (out / "README.md").write_text("QLoRA adapter: trained on the NF4 4-bit (double quantization) base.\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="QLoRA training steps (default 30)")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    args = parser.parse_args(argv)
    base = cache_dir() / "smollm2-135m-instruct"
    if not is_complete(base):
        print(f"{base}: missing; run `make fixtures` first", file=sys.stderr)
        return 2
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    with tempfile.TemporaryDirectory(prefix="qlora-bench-") as tmp:
        work = Path(tmp)
        print("training a QLoRA adapter on the NF4 base ...", flush=True)
        train_qlora(base, work / "lora", args.steps)
        converter = [sys.executable, "-m", "converter", "merge", "--base", str(base), "--adapter", str(work / "lora")]
        subprocess.run([*converter, "--out", str(work / "original")], check=True)  # verifies: QLoRA study inside
        subprocess.run([*converter, "--out", str(work / "dequantized"), "--qlora-base", "dequantized", "--no-verify"])
        study = json.loads((work / "original" / "verification.json").read_text())["qlora"]

        def fp(folder: Path):
            return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

        four_bit = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, quantization_config=nf4())
        models = {
            "base, full precision (no adapter)": lambda: fp(base),
            "QLoRA setting: NF4 base + adapter (PEFT)": lambda: PeftModel.from_pretrained(four_bit, work / "lora"),
            "full-precision base + adapter (PEFT, unmerged)": lambda: PeftModel.from_pretrained(
                fp(base), work / "lora"
            ),
            "merged onto the original weights": lambda: fp(work / "original"),
            "merged onto the dequantized NF4 weights": lambda: fp(work / "dequantized"),
        }
        scores = {}
        for name, make in models.items():
            model = make().eval()
            scores[name] = (perplexity(model, tok, TRAIN), perplexity(model, tok, HELD_OUT))
    deq, orig = scores["merged onto the dequantized NF4 weights"], scores["merged onto the original weights"]
    change = [d / o - 1 for d, o in zip(deq, orig, strict=True)]
    kl = {m: study["modes"][m]["vs_qlora_reference"]["mean_kl"] for m in ("original", "dequantized")}
    text = "\n".join(
        [
            f"\n## QLoRA merge base on SmolLM2-135M-Instruct ({args.steps} QLoRA steps, r=16, all-linear, NF4 + "
            "double quantization)",
            "",
            "| model | perplexity, training text | perplexity, held-out text |",
            "|---|---|---|",
            *(f"| {name} | {train:.3f} | {held:.3f} |" for name, (train, held) in scores.items()),
            "",
            f"Converter's verification (4 chat prompts, vs the NF4 reference): mean KL original {kl['original']:.3g}, "
            f"dequantized {kl['dequantized']:.3g}; closer: **{study['closer']}** ({study['kl_ratio']:.3g}x). "
            f"Perplexity of the dequantized merge relative to the original merge: {change[0]:+.2%} on the training "
            f"text, {change[1]:+.2%} held out.",
            "",
        ]
    )
    print(text)
    if not args.no_record:
        with open(BENCH_DIR / "RESULTS.md", "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
