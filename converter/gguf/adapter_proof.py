"""The proof of an adapter GGUF, in two parts, each naming what is wrong when it fails.

1. File: read back with gguf's reader, the keys llama.cpp reads (architecture, general.type, adapter.type,
   adapter.lora.alpha) say what was planned, and every lora_a / lora_b, dequantized and lora_b put back in Hugging
   Face row order (the inverse of the base's Q/K reordering, independent of the writer), equals the adapter's A / B
   (alpha ratio folded into B where a module's alpha differs from the file's; the token embeddings' A transposed,
   one row per token, as llama.cpp gathers it): exactly in F32, as cast in F16 / BF16, bit-identical to gguf's
   reference quantization in Q8_0. Every module is there, nothing else is.
2. Behaviour: llama.cpp runs the base GGUF (F32, written for the proof) with the adapter applied at run time; its
   logits are compared with transformers' logits of the base with the adapter applied by PEFT, unmerged, on the
   same token ids; the relative RMS difference stays under converter.gguf.proof.BEHAVIOUR_LIMIT for the adapter's
   type (proof.prove_behaviour, as for a model's GGUF: on a MoE base each text is compared up to its first near tie
   of a router). A wrong alpha or an un-reordered Q/K lora_b moves llama.cpp's logits far beyond it.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from converter.gguf import arch
from converter.gguf.adapter import AdapterPlan, stored_type
from converter.gguf.fileio import Reader
from converter.gguf.proof import Part, Reference, _read_back, batched_logits


def prove_file(path: Path, planned: AdapterPlan, family: arch.Family, type_name: str) -> Part:
    """Part 1: the keys llama.cpp reads and every factor, read back, against the plan."""
    reader = Reader(path)

    def value(key: str):
        f = reader.get_field(key)
        return None if f is None else f.contents()

    want = {"general.architecture": arch.arch_name(family), "general.type": "adapter",
            gguf.Keys.Adapter.TYPE: "lora"}  # fmt: skip
    for key, expected in want.items():
        if value(key) != expected:
            return Part("file", False, f"{key} is {value(key)!r}, expected {expected!r}")
    alpha = value(gguf.Keys.Adapter.LORA_ALPHA)
    if alpha is None or np.float32(alpha) != np.float32(planned.alpha):
        return Part("file", False, f"{gguf.Keys.Adapter.LORA_ALPHA} is {alpha!r}, the adapter's alpha is "
                    f"{planned.alpha!r}")  # fmt: skip
    found = {t.name: t for t in reader.tensors}
    expected_names = set()
    for p in planned.pairs:
        for part, src in (("lora_a", expected_token_rows(p.a) if p.embedding else p.a), ("lora_b", p.b)):
            name = f"{p.name}.{part}"
            expected_names.add(name)
            if name not in found:
                return Part("file", False, f"{name} ({p.source}) is missing from the file")
            t = found[name]
            shape = tuple(int(d) for d in reversed(t.shape))
            if shape != src.shape:
                return Part("file", False, f"{name} ({p.source}) has shape {shape}, expected {src.shape}")
            if t.tensor_type != stored_type(src.shape, type_name):
                return Part("file", False, f"{name} is stored as {t.tensor_type.name}, expected "
                            f"{stored_type(src.shape, type_name).name}")  # fmt: skip
            got = _read_back(t).reshape(shape)
            if part == "lora_b" and p.transform is not None:
                got = p.transform.to_hf(got)  # llama.cpp's row order back to Hugging Face's
            want_values = (
                src
                if t.tensor_type == gguf.GGMLQuantizationType.F32
                else gguf.quants.dequantize(gguf.quants.quantize(src, t.tensor_type), t.tensor_type).reshape(shape)
            )
            if not np.array_equal(got, want_values, equal_nan=True):
                bad = int(np.sum(got != want_values))
                order = "one row per token" if p.embedding and part == "lora_a" else "in Hugging Face row order"
                return Part(
                    "file",
                    False,
                    f"{name} ({p.source}): {bad} values differ from the adapter's "
                    f"{'A' if part == 'lora_a' else 'B'} as {t.tensor_type.name} ({order})",
                )
    extra = sorted(set(found) - expected_names)
    if extra:
        return Part("file", False, f"{extra[0]} is in the file but comes from no module of the adapter")
    return Part("file", True, f"{len(planned.pairs)} LoRA pairs and alpha {planned.alpha:g} read back equal to the "
                f"adapter's as {type_name}")  # fmt: skip


def expected_token_rows(a: np.ndarray) -> np.ndarray:
    """What token_embd.weight.lora_a must hold for an embedding LoRA's A (rank, vocab): A transposed, row t the
    rank values of token t (llama.cpp's ggml_get_rows on lora_a); the proof's own, not the writer's."""
    return np.ascontiguousarray(np.transpose(a))


def peft_reference(base: Path, adapter_folder: Path, ref: Reference) -> int:
    """Fill `ref` with transformers' float32 logits of the base with the PEFT adapter applied unmerged (PEFT's own
    forward) and, on a MoE base, its router gaps (the adapter moves the routers' inputs, so the near ties are those
    of base + adapter); returns how many modules PEFT applied it to (PEFT skips what it does not find)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    experts = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
    model = PeftModel.from_pretrained(model, adapter_folder).eval()
    applied = sum(1 for m in model.modules() if any(len(getattr(m, factors, None) or ()) for factors in
                                                    ("lora_A", "lora_embedding_A")))  # fmt: skip
    with torch.no_grad():
        ref.logits, ref.router_gaps = batched_logits(model, ref.inputs, experts)
    del model
    return applied
