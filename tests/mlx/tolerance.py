"""Measure the MLX behaviour proof's differences on right exports (what BEHAVIOUR_LIMIT in converter/mlx/proof.py
is set from; docs/mlx.md has the table). Not a test: run it by hand, `.venv/bin/python tests/mlx/tolerance.py`.

Each architecture is built tiny, in bf16 and in float32, with random weights and a random LoRA on every linear layer,
merged, exported as every MLX type with the limits lifted, and the relative RMS difference of mlx-lm's logits from
the merged model's (torch, float32) printed.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from test_mlx import merged  # noqa: E402

ARCHS = ("llama", "qwen2", "mistral", "gemma2", "gemma3_text", "qwen3", "phi3")


def main() -> None:
    from converter.mlx import export, proof
    from converter.mlx.types import TYPES

    proof.BEHAVIOUR_LIMIT.update(dict.fromkeys(proof.BEHAVIOUR_LIMIT, float("inf")))
    worst = dict.fromkeys(TYPES, 0.0)
    for arch in sys.argv[1:] or ARCHS:
        for dtype in (torch.bfloat16, torch.float32):
            with tempfile.TemporaryDirectory() as tmp:
                extra = {"num_hidden_layers": 6} if arch == "gemma3_text" else {}  # mlx-lm needs a full pattern
                src = merged(Path(tmp), arch, dtype, **extra)
                targets = {t: Path(tmp) / f"m-{t}" for t in TYPES}
                result = export.export(src, list(TYPES.values()), targets, log=lambda s: None)
                found = {fp.type: float(fp.parts[-1].detail.split("RMS ")[1].split()[0]) for fp in result.proofs}
            for t, v in found.items():
                worst[t] = max(worst[t], v)
            print(arch, str(dtype).removeprefix("torch."), " ".join(f"{t} {v:.4f}" for t, v in found.items()))
    print("largest", " ".join(f"{t} {v:.4f}" for t, v in worst.items()))


if __name__ == "__main__":
    main()
