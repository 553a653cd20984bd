"""Architectures: which Hugging Face models become which llama.cpp architecture, with which metadata, tensor names
and tensor transforms.

Why a table: llama.cpp's loader reads a fixed set of keys per architecture and finds tensors by gguf's names
(`gguf.TensorNameMap`); a rotary model of the Llama line stores Q and K with the rows of each head interleaved the
way llama.cpp's rope expects (`permute`), the Qwen line does not. What is not in the table is refused in one line,
before anything is written.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np

from converter.errors import BadInputError


@dataclass(frozen=True)
class Family:
    """How one Hugging Face model_type maps onto llama.cpp."""

    arch: gguf.MODEL_ARCH
    permute_qk: bool = False  # Q/K rows reordered for llama.cpp's rope (the Llama line)
    vocab_size_key: bool = False  # writes {arch}.vocab_size and {arch}.rope.dimension_count
    spm_first: bool = True  # a tokenizer.model (SentencePiece) is preferred when present
    llama_hf_vocab: bool = False  # a SentencePiece-style tokenizer.json is read as llama's (gguf.LlamaHfVocab)


FAMILIES: dict[str, Family] = {
    "llama": Family(gguf.MODEL_ARCH.LLAMA, permute_qk=True, vocab_size_key=True, llama_hf_vocab=True),
    "mistral": Family(gguf.MODEL_ARCH.LLAMA, permute_qk=True, vocab_size_key=True, llama_hf_vocab=True),
    "qwen2": Family(gguf.MODEL_ARCH.QWEN2),
    "qwen3": Family(gguf.MODEL_ARCH.QWEN3),
}


def family_of(config: dict, where: object) -> Family:
    """The family of a config.json, or a one-line error naming the model_type and what is supported."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise BadInputError(
            f"{where}: GGUF export does not support model_type {model_type!r} yet "
            f"(supported: {', '.join(sorted(FAMILIES))})",
            file=where,
        )  # fmt: skip
    return FAMILIES[model_type]


def arch_name(family: Family) -> str:
    return gguf.MODEL_ARCH_NAMES[family.arch]


def block_count(config: dict) -> int:
    return int(config["num_hidden_layers"])


def head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def rope_parameters(config: dict) -> dict:
    """transformers 5 keeps rope settings in `rope_parameters`, older configs in `rope_scaling` + `rope_theta`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "rope_theta" not in params and config.get("rope_theta") is not None:
        params["rope_theta"] = config["rope_theta"]
    if "rope_type" not in params and params.get("type") is not None:
        params["rope_type"] = params["type"]
    return params


def add_model_metadata(w: gguf.GGUFWriter, config: dict, family: Family) -> None:
    """The `{arch}.*` keys llama.cpp's loader reads for these families."""
    w.add_block_count(block_count(config))
    w.add_context_length(int(config["max_position_embeddings"]))
    w.add_embedding_length(int(config["hidden_size"]))
    w.add_feed_forward_length(int(config["intermediate_size"]))
    w.add_head_count(int(config["num_attention_heads"]))
    if config.get("num_key_value_heads") is not None:
        w.add_head_count_kv(int(config["num_key_value_heads"]))
    rope = rope_parameters(config)
    kind = (rope.get("rope_type") or "default").lower()
    if kind == "linear" and rope.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn" and rope.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif kind not in ("default", "llama3"):
        raise BadInputError(f"config.json: rope_type {kind!r} is not supported by GGUF export yet")
    if rope.get("rope_theta") is not None:
        w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    if config.get("head_dim") is not None:
        w.add_key_length(int(config["head_dim"]))
        w.add_value_length(int(config["head_dim"]))
    if family.vocab_size_key:
        w.add_vocab_size(int(config["vocab_size"]))
        w.add_rope_dimension_count(head_dim(config))


def rope_freqs(config: dict) -> np.ndarray | None:
    """Llama 3's rope scaling as llama.cpp takes it: a per-frequency factor tensor (`rope_freqs.weight`)."""
    rope = rope_parameters(config)
    if (rope.get("rope_type") or "").lower() != "llama3":
        return None
    base, dim = float(rope.get("rope_theta", 10000.0)), head_dim(config)
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's rotary halves -> llama.cpp's interleaved pairs, per head (rows of a Q or K projection)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute`: llama.cpp's row order back to Hugging Face's."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def row_transform(hf_name: str, config: dict, family: Family) -> tuple[Callable | None, Callable | None]:
    """(to GGUF, back to Hugging Face) for this tensor, or (None, None) when it is stored as it is."""
    if not family.permute_qk:
        return None, None
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        n = int(config["num_attention_heads"])
    elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        n = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    else:
        return None, None
    return (lambda w: permute(w, n)), (lambda w: unpermute(w, n))


SKIPPED = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")


def gguf_name(hf_name: str, tmap: gguf.TensorNameMap, where: object) -> str:
    """gguf's own name for a Hugging Face tensor; a tensor with no place in the architecture is named."""
    name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise BadInputError(f"{where}: tensor {hf_name} has no place in a llama.cpp model of this architecture",
                            file=where, tensor=hf_name)  # fmt: skip
    return name
