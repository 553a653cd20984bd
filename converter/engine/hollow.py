"""A causal LM built without its weights, for a proof's reference logits: each weight read from its file, in
float32, when its layer runs (converter.engine.precision.float32_compute).

Why: transformers' `from_pretrained` loads every weight before the first layer runs (1.8 GB for a 0.9 B bf16 model,
held while the reference computes); here memory holds a layer or two whatever the model's size, and the weights are
read once. The GGUF and MLX proofs use it for the merged model's logits. Only where every parameter is a tensor of the
files as the model holds it (same name, same shape): a model whose loading renames, fuses or converts weights
(transformers 5's fused MoE experts) returns None, and is loaded by transformers as before.
"""

from __future__ import annotations

from pathlib import Path

from converter.engine.checkpoint import Checkpoint
from converter.engine.model_class import config_object, hollow_model
from converter.engine.precision import FileTensor, file_sources, own_dtype
from converter.io import libc


def hollow_causal_lm(folder: Path, config: dict, class_name: str | None = None):
    """(model, sources for float32_compute) of the model in `folder` (its config.json's contents: `config`), the
    model eval-mode, float32, eager attention, no weight in memory; None where a weight has no tensor of the files to
    be read from (or the config names no causal LM class)."""
    import torch

    names = [n for n in config.get("architectures") or [] if n.endswith("ForCausalLM")]
    class_name = class_name or (names[0] if names else None)
    if class_name is None:
        return None
    files = Checkpoint(folder)
    config = config_object(config)
    config._attn_implementation = "eager"  # the attention as written (Gemma 2's soft-capping)
    model = hollow_model(config, class_name)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.device.type == "meta":  # a zero-stride stand-in of its shape: no memory, read when its layer runs
                stand_in = torch.zeros((), dtype=p.dtype).expand(p.shape)
                module._parameters[name] = torch.nn.Parameter(stand_in, requires_grad=False)
        if any(b is not None and b.device.type == "meta" for b in module.buffers(recurse=False)):
            return None  # a buffer transformers would load from the files
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    sources: dict[int, FileTensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):  # tied weights: the first name read
        if id(p) in sources:
            continue
        where = files.where.get(name)
        e = where.tensors[name] if where is not None else None
        if e is None or tuple(e.shape) != tuple(p.shape):
            return None
        sources[id(p)] = FileTensor(where.path, e.start, e.end, e.dtype)
    return model.eval(), sources


def causal_lm_reading_files(folder: Path, config: dict):
    """(model, sources for float32_compute) of the causal LM in `folder`: hollow where it can be
    (hollow_causal_lm), else loaded by transformers in its own dtype, eager attention (as written, with Gemma 2's
    soft-capping, which the fused kernels leave out), eval-mode; its weights read from their files either way."""
    hollow = hollow_causal_lm(folder, config)
    if hollow is not None:
        return hollow
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=own_dtype(folder), attn_implementation="eager")
    return model.eval(), file_sources(model, folder)


def release_heap() -> None:
    """Free heap memory back to the system (glibc's malloc_trim; elsewhere nothing). After a verified merge, blocks
    below 64 MiB come from the heap (converter.verification.heap raises glibc's threshold for the merge's proofs),
    so the reference's float32 layers, once freed, would stay in the process while llama.cpp maps the whole file."""
    import ctypes

    trim = libc.function("malloc_trim", ctypes.c_size_t)
    if trim is not None:
        trim(0)
