"""The proof of an MLX folder, in three parts, each naming what is wrong when it fails.

1. Tensors: every tensor of the folder read back equals what the layout says it is made of: the merged tensor,
   cast as mlx-lm casts it and quantized by `mx.quantize` (stored bytes compared, no float comparison); every
   tensor mlx-lm's model needs is there and nothing else.
2. Config: config.json is the merged model's, with the `quantization` block of the type (or none for bf16).
3. Behaviour: mlx-lm loads the folder (`mlx_lm.load`, on the CPU) and runs seeded token ids; its logits against
   the merged model's in torch, computing in float32 (weights read from their files one layer at a time). The
   relative RMS difference must stay under the type's limit, measured on right exports (BEHAVIOUR_LIMIT).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from converter import outcome
from converter.io.safetensors_file import SafetensorsFile
from converter.mlx import runtime
from converter.mlx.layout import Layout
from converter.mlx.write import Tensors, as_bytes

# Relative RMS difference of mlx-lm's logits from the merged model's (torch, float32) on the seeded ids, per type.
# Measured on right exports of tiny llama, qwen2, mistral, gemma2, gemma3_text, qwen3 and phi3 models (bf16 and
# float32 bases with random weights, merged with a random LoRA: no structure for the groups to exploit, so these are
# worst cases); docs/mlx.md has the table. Each limit is about 1.5x the largest measured (0.55, 0.094, 0.065). mlx
# computes in the weights' dtype (bf16 activations), so even bf16 is not exact.
BEHAVIOUR_LIMIT = {"bf16": 0.1, "8bit": 0.15, "4bit": 0.8}
SEED = 0
ROWS, LENGTH = 2, 24


Part = outcome.ProofPart  # one part of a folder's proof


class FolderProof(outcome.PartsProof):
    """One MLX folder's proof."""

    KEY = "folder"

    def as_proofs(self) -> outcome.Proofs:
        """For a verb's outcome; what a failed folder's VerificationFailed reports."""
        return outcome.Proofs(mlx=(self.summary(),))


def seeded_ids(vocab_size: int) -> list[list[int]]:
    """ROWS rows of LENGTH token ids drawn with SEED: the same for every type and every run."""
    rng = np.random.default_rng(SEED)
    return rng.integers(0, vocab_size, size=(ROWS, LENGTH)).tolist()


def prove_tensors(folder: Path, layout: Layout) -> Part:
    """Every tensor read back against the layout's recipe for it, byte for byte."""
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        f = SafetensorsFile(path)
        found.update({name: (f, info) for name, info in f.tensors.items()})
    planned = {t.name: t for t in layout.tensors}
    if extra := sorted(set(found) - set(planned)):
        return Part("tensors", False, f"{extra[0]} is not a tensor mlx-lm's model has ({len(extra)} such)")
    if missing := sorted(set(planned) - set(found)):
        return Part("tensors", False, f"{missing[0]} is missing ({len(missing)} missing)")
    made = Tensors(layout)
    for t in layout.tensors:
        f, info = found[t.name]
        if (info.dtype, tuple(info.shape)) != (t.dtype, t.shape):
            return Part("tensors", False, f"{t.name}: {info.dtype} {list(info.shape)}, expected {t.dtype} "
                                          f"{list(t.shape)}")  # fmt: skip
        if not np.array_equal(f.read_bytes(t.name), np.frombuffer(as_bytes(made.make(t)), np.uint8)):
            how = "mx.quantize's" if t.quant else "the merged tensor's"
            return Part("tensors", False, f"{t.name}: its bytes are not {how} (from {t.source})")
    quantized = len({t.name.rpartition(".")[0] for t in layout.tensors if t.quant})
    return Part("tensors", True, f"{len(planned)} tensors identical to the merged model's" +
                (f", {quantized} modules quantized by mx.quantize" if quantized else ""))  # fmt: skip


def prove_config(folder: Path, source: Path, layout: Layout) -> Part:
    """config.json: the merged model's, with the type's quantization block."""
    written = json.loads((folder / "config.json").read_text())
    merged = json.loads((source / "config.json").read_text())
    if written.get("model_type") != merged.get("model_type"):
        return Part("config", False, f"model_type {written.get('model_type')!r}, the merged model's is "
                                     f"{merged.get('model_type')!r}")  # fmt: skip
    t = layout.type
    want = None if t.bits is None else {"group_size": t.group_size, "bits": t.bits, "mode": t.mode}
    got = written.get("quantization")
    if want is None and got is not None or want is not None and {k: (got or {}).get(k) for k in want} != want:
        return Part("config", False, f"quantization block {got}, expected {want}")
    for key, value in merged.items():
        if key not in ("_name_or_path", "quantization", "quantization_config") and written.get(key, value) != value:
            return Part("config", False, f"{key} is {written.get(key)!r}, the merged model's is {value!r}")
    return Part("config", True, "the merged model's config" + (f" with quantization {want}" if want else ""))


def mlx_logits(folder: Path, ids: list[list[int]]) -> np.ndarray:
    """mlx-lm's logits for `ids`, the folder loaded by mlx_lm.load on the CPU."""
    mx, lm = runtime.require("the MLX proof")
    with runtime.quietly():
        model, _ = lm.load(str(folder))
    out = model(mx.array(ids))
    return np.array(out.astype(mx.float32))


def reference_logits(source: Path, ids: list[list[int]]) -> np.ndarray:
    """The merged model's logits in torch, computing in float32, its weights left in their files and read one layer
    at a time (converter.engine.precision): a float32 load's results, with memory that does not grow with the model.
    The model is built without weights where its parameters are the files' tensors as they are
    (converter.engine.hollow), else loaded by transformers in its own dtype."""
    import torch

    from converter.engine.hollow import causal_lm_reading_files, release_heap
    from converter.engine.precision import float32_compute

    model, sources = causal_lm_reading_files(source, json.loads((source / "config.json").read_text()))
    with torch.no_grad(), float32_compute(model, sources):
        logits = model(input_ids=torch.tensor(ids)).logits.float().numpy()
    del model
    release_heap()  # the float32 layers' memory back before mlx-lm loads the folder
    return logits


def prove_behaviour(folder: Path, ids: list[list[int]], reference: np.ndarray, type_name: str) -> Part:
    try:
        got = mlx_logits(folder, ids)
    except Exception as e:  # mlx-lm could not load or run it: that is the finding
        return Part("behaviour", False, f"mlx-lm could not run the folder: {type(e).__name__}: {e}")
    if got.shape != reference.shape:
        return Part("behaviour", False, f"mlx-lm's logits have shape {list(got.shape)}, the merged model's "
                                        f"{list(reference.shape)}")  # fmt: skip
    rel = relative_rms(got, reference)
    limit = BEHAVIOUR_LIMIT[type_name]
    detail = f"mlx-lm's logits vs the merged model's (float32): relative RMS {rel:.4f} (limit {limit})"
    return Part("behaviour", bool(rel <= limit), detail)


def relative_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm((a - b).ravel()) / max(np.linalg.norm(b.ravel()), 1e-30))
