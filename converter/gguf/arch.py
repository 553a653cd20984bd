"""Architectures: which Hugging Face models become which llama.cpp architecture, with which metadata, tensor names
and tensor transforms.

Why a table: llama.cpp's loader reads a fixed set of keys per architecture and finds tensors by gguf's names
(`gguf.TensorNameMap`); a rotary model of the Llama line stores Q and K with the rows of each head interleaved the
way llama.cpp's rope expects (`permute`), the Qwen, Gemma and Phi lines do not; Gemma's norms are stored + 1 (its
RMSNorm multiplies by 1 + weight), GPT-2's Conv1D weights transposed. What is not in the table is refused in one
line, before anything is written.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import gguf
import numpy as np

from converter.errors import BadInputError


def _get(config: dict, *names: str, default=None):
    """The first of `names` that config.json has (GPT-2 says n_embd where others say hidden_size)."""
    return next((config[n] for n in names if config.get(n) is not None), default)


def block_count(config: dict) -> int:
    return int(_get(config, "num_hidden_layers", "n_layer"))


def head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def rope_parameters(config: dict) -> dict:
    """The full-attention layers' rope settings: transformers 5 keeps them in `rope_parameters` (per layer type for
    Gemma 3), older configs in `rope_scaling` + `rope_theta`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params = dict(params.get("full_attention", params))
    if "rope_theta" not in params and config.get("rope_theta") is not None:
        params["rope_theta"] = config["rope_theta"]
    if "rope_type" not in params and params.get("type") is not None:
        params["rope_type"] = params["type"]
    return params


def swa_rope_theta(config: dict) -> float | None:
    """The sliding-window layers' rope base where it has its own (Gemma 3's local layers)."""
    params = config.get("rope_parameters") or {}
    theta = (params.get("sliding_attention") or {}).get("rope_theta")
    return theta if theta is not None else config.get("rope_local_base_freq")


def _rope_scaling(w: gguf.GGUFWriter, config: dict) -> None:
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


def _sizes(w: gguf.GGUFWriter, config: dict) -> None:
    w.add_block_count(block_count(config))
    w.add_context_length(int(config["max_position_embeddings"]))
    w.add_embedding_length(int(config["hidden_size"]))
    w.add_feed_forward_length(int(config["intermediate_size"]))
    w.add_head_count(int(config["num_attention_heads"]))
    if config.get("num_key_value_heads") is not None:
        w.add_head_count_kv(int(config["num_key_value_heads"]))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))


def _head_length(w: gguf.GGUFWriter, config: dict) -> None:
    if config.get("head_dim") is not None:
        w.add_key_length(int(config["head_dim"]))
        w.add_value_length(int(config["head_dim"]))


def _llama_metadata(w: gguf.GGUFWriter, config: dict, family: Family) -> None:
    """Llama, Mistral, Qwen2/3 and Gemma 3: the keys llama.cpp's converter writes for any text model."""
    _sizes(w, config)
    _rope_scaling(w, config)
    rope = rope_parameters(config)
    if rope.get("rope_theta") is not None:
        w.add_rope_freq_base(float(rope["rope_theta"]))
    if family.experts:
        w.add_expert_count(expert_count(config))
        w.add_expert_used_count(int(config["num_experts_per_tok"]))
        if config.get("moe_intermediate_size") is not None:
            w.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
        if config.get("shared_expert_intermediate_size") is not None:
            w.add_expert_shared_feed_forward_length(int(config["shared_expert_intermediate_size"]))
    _head_length(w, config)
    if family.vocab_size_key:
        w.add_vocab_size(int(config["vocab_size"]))
        w.add_rope_dimension_count(head_dim(config))


def _gemma2_metadata(w: gguf.GGUFWriter, config: dict, family: Family) -> None:
    """Gemma 2: soft-capping and the sliding window; the rope base only where it is not llama.cpp's default."""
    _sizes(w, config)
    _head_length(w, config)
    w.add_attn_logit_softcapping(float(config["attn_logit_softcapping"]))
    w.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    w.add_sliding_window(int(config["sliding_window"]))
    theta = rope_parameters(config).get("rope_theta", ROPE_BASE_DEFAULT)
    if float(theta) != ROPE_BASE_DEFAULT:
        w.add_rope_freq_base(float(theta))


def _gemma3_metadata(w: gguf.GGUFWriter, config: dict, family: Family) -> None:
    """Gemma 3 (text): the common keys, the local layers' own rope base, the sliding window."""
    _llama_metadata(w, config, family)
    if swa_rope_theta(config) is not None:
        w.add_rope_freq_base_swa(float(swa_rope_theta(config)))
    if config.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    if config.get("sliding_window_pattern") != 1:
        w.add_sliding_window(int(config["sliding_window"]))


def _phi3_metadata(w: gguf.GGUFWriter, config: dict, family: Family) -> None:
    """Phi-3: the rotary dimensions and the original context length; sliding window 0 where there is none; for the
    long-context models (longrope) the attention factor, their per-frequency factors being tensors
    (`extra_tensors`)."""
    rope = rope_parameters(config)
    kind = (rope.get("rope_type") or "default").lower()
    original = rope.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    if rope.get("long_factor"):
        w.add_rope_scaling_attn_factors(_longrope_attention_factor(config, kind, original))
    elif kind != "default":
        raise BadInputError(f"config.json: Phi-3 with rope_type {kind!r} is not supported by GGUF export yet")
    _sizes(w, config)
    if original is not None:
        w.add_rope_scaling_orig_ctx_len(int(original))
    w.add_rope_dimension_count(rope_dimensions(config))
    w.add_rope_freq_base(float(rope.get("rope_theta", ROPE_BASE_DEFAULT)))
    w.add_sliding_window(int(config.get("sliding_window") or 0))


def _longrope_attention_factor(config: dict, kind: str, original: int | None) -> float:
    """The attention scale of Phi-3's long-context rope, as llama.cpp's converter computes it from the context
    lengths; its long and short factors must cover half the rotary dimensions."""
    rope = rope_parameters(config)
    if original is None:
        raise BadInputError("config.json: Phi-3's long-context rope needs original_max_position_embeddings")
    half = rope_dimensions(config) // 2
    if len(rope["long_factor"]) != half or len(rope.get("short_factor") or []) != half:
        raise BadInputError(f"config.json: Phi-3's long_factor and short_factor must have {half} values each")
    scale = int(config["max_position_embeddings"]) / int(original)
    if kind in ("su", "longrope"):
        return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    if kind == "yarn":
        return 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
    raise BadInputError(f"config.json: Phi-3 with rope_type {kind!r} is not supported by GGUF export yet")


def rope_dimensions(config: dict) -> int:
    """How many of each head's dimensions rotate (Phi-3's partial_rotary_factor, of hidden_size / heads)."""
    fraction = rope_parameters(config).get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return int(fraction * int(config["hidden_size"])) // int(config["num_attention_heads"])


def gpt2_feed_forward(config: dict) -> int:
    return int(config.get("n_inner") or 4 * int(config["n_embd"]))


def _gpt2_metadata(w: gguf.GGUFWriter, config: dict, family: Family) -> None:
    """GPT-2: learned positions (their count is the context length), LayerNorm with bias, no rope."""
    w.add_block_count(block_count(config))
    w.add_context_length(int(config["n_positions"]))
    w.add_embedding_length(int(config["n_embd"]))
    w.add_feed_forward_length(gpt2_feed_forward(config))
    w.add_head_count(int(config["n_head"]))
    w.add_layer_norm_eps(float(config["layer_norm_epsilon"]))


ROPE_BASE_DEFAULT = 10000.0


@dataclass(frozen=True)
class Family:
    """How one Hugging Face model_type maps onto llama.cpp."""

    arch: gguf.MODEL_ARCH
    metadata: Callable[[gguf.GGUFWriter, dict, Family], None] = _llama_metadata
    permute_qk: bool = False  # Q/K rows reordered for llama.cpp's rope (the Llama line)
    vocab_size_key: bool = False  # writes {arch}.vocab_size and {arch}.rope.dimension_count
    spm_first: bool = True  # a tokenizer.model (SentencePiece) is preferred when present
    llama_hf_vocab: bool = False  # a SentencePiece-style tokenizer.json is read as llama's (gguf.LlamaHfVocab)
    vocab: str = "auto"  # "phi3": Phi-3's own reading (SentencePiece, or BPE when the tokenizer class says GPT-2)
    norm_plus_one: bool = False  # Gemma's RMSNorm multiplies by (1 + weight): llama.cpp stores weight + 1
    transposed: tuple[str, ...] = ()  # GPT-2's Conv1D weights, stored (in, out): llama.cpp takes (out, in)
    tied_head: tuple[str, str] | None = None  # (head, embeddings): a head llama.cpp drops and takes from the embeddings
    experts: bool = False  # a MoE layer's experts, saved one by one, are stacked per projection: (experts, out, in)
    topk_norm: bool | None = None  # llama.cpp renormalizes the chosen experts' weights (Qwen3-MoE) or not (Qwen2-MoE)


FAMILIES: dict[str, Family] = {
    "llama": Family(gguf.MODEL_ARCH.LLAMA, permute_qk=True, vocab_size_key=True, llama_hf_vocab=True),
    "mistral": Family(gguf.MODEL_ARCH.LLAMA, permute_qk=True, vocab_size_key=True, llama_hf_vocab=True),
    "mixtral": Family(gguf.MODEL_ARCH.LLAMA, permute_qk=True, vocab_size_key=True, llama_hf_vocab=True, experts=True),
    "qwen2": Family(gguf.MODEL_ARCH.QWEN2),
    "qwen3": Family(gguf.MODEL_ARCH.QWEN3),
    "qwen2_moe": Family(gguf.MODEL_ARCH.QWEN2MOE, experts=True, topk_norm=False),
    "qwen3_moe": Family(gguf.MODEL_ARCH.QWEN3MOE, experts=True, topk_norm=True),
    "gemma2": Family(gguf.MODEL_ARCH.GEMMA2, _gemma2_metadata, norm_plus_one=True,
                     tied_head=("lm_head.weight", "model.embed_tokens.weight")),
    "gemma3_text": Family(gguf.MODEL_ARCH.GEMMA3, _gemma3_metadata, norm_plus_one=True),
    "phi3": Family(gguf.MODEL_ARCH.PHI3, _phi3_metadata, vocab="phi3"),
    "gpt2": Family(gguf.MODEL_ARCH.GPT2, _gpt2_metadata, spm_first=False,
                   transposed=(".c_attn.weight", ".c_proj.weight", ".c_fc.weight")),
}  # fmt: skip


def family_of(config: dict, where: object) -> Family:
    """The family of a config.json, or a one-line error naming the model_type and what is supported."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise BadInputError(
            f"{where}: GGUF export does not support model_type {model_type!r} yet "
            f"(supported: {', '.join(sorted(FAMILIES))})",
            file=where,
        )  # fmt: skip
    family = FAMILIES[model_type]
    if family.norm_plus_one:
        _check_gemma_attention_scale(config, where)
    if family.topk_norm is not None and bool(config.get("norm_topk_prob")) != family.topk_norm:
        raise BadInputError(
            f"{where}: norm_topk_prob is {config.get('norm_topk_prob')}, but llama.cpp's {arch_name(family)} "
            f"{'always' if family.topk_norm else 'never'} renormalizes the chosen experts' weights: a GGUF of it "
            "would not compute what the model computes",
            file=where,
        )  # fmt: skip
    return family


def expert_count(config: dict) -> int | None:
    n = _get(config, "num_local_experts", "num_experts")
    return None if n is None else int(n)


def _check_gemma_attention_scale(config: dict, where: object) -> None:
    """llama.cpp scales Gemma's attention by 1/sqrt(head_dim), or 1/sqrt(hidden / heads) for the 27B models (known
    by their layer count); a config whose query_pre_attn_scalar says otherwise would run wrong."""
    scalar = config.get("query_pre_attn_scalar")
    big = block_count(config) == (46 if config.get("model_type") == "gemma2" else 62)
    llama_cpp = config["hidden_size"] // config["num_attention_heads"] if big else head_dim(config)
    if scalar is not None and int(scalar) != llama_cpp:
        raise BadInputError(
            f"{where}: query_pre_attn_scalar is {scalar}, but llama.cpp scales this model's attention by "
            f"{llama_cpp}: a GGUF of it would not compute what the model computes",
            file=where,
        )  # fmt: skip


def arch_name(family: Family) -> str:
    return gguf.MODEL_ARCH_NAMES[family.arch]


def add_model_metadata(w: gguf.GGUFWriter, config: dict, family: Family) -> None:
    """The `{arch}.*` keys llama.cpp's loader reads for this family, as llama.cpp's converter writes them."""
    family.metadata(w, config, family)


def expected_metadata(config: dict, family: Family) -> dict[str, object]:
    """What the proof checks in the file: the keys llama.cpp sizes and runs the model by, read from config.json
    here independently of the writer."""
    a, c = arch_name(family), config
    if family.arch == gguf.MODEL_ARCH.GPT2:
        return {
            f"{a}.block_count": c["n_layer"], f"{a}.context_length": c["n_positions"],
            f"{a}.embedding_length": c["n_embd"], f"{a}.feed_forward_length": gpt2_feed_forward(c),
            f"{a}.attention.head_count": c["n_head"], f"{a}.attention.layer_norm_epsilon": c["layer_norm_epsilon"],
        }  # fmt: skip
    want = {
        f"{a}.block_count": c["num_hidden_layers"],
        f"{a}.context_length": c["max_position_embeddings"],
        f"{a}.embedding_length": c["hidden_size"],
        f"{a}.feed_forward_length": c["intermediate_size"],
        f"{a}.attention.head_count": c["num_attention_heads"],
        f"{a}.attention.head_count_kv": c.get("num_key_value_heads") or c["num_attention_heads"],
        f"{a}.attention.layer_norm_rms_epsilon": c["rms_norm_eps"],
    }
    theta = float(rope_parameters(c).get("rope_theta", ROPE_BASE_DEFAULT))
    if family.arch != gguf.MODEL_ARCH.GEMMA2 or theta != ROPE_BASE_DEFAULT:  # Gemma 2: llama.cpp's default
        want[f"{a}.rope.freq_base"] = theta
    if family.arch == gguf.MODEL_ARCH.GEMMA2:
        want[f"{a}.attn_logit_softcapping"] = c["attn_logit_softcapping"]
        want[f"{a}.final_logit_softcapping"] = c["final_logit_softcapping"]
    if family.arch == gguf.MODEL_ARCH.GEMMA3 and swa_rope_theta(c) is not None:
        want[f"{a}.rope.freq_base_swa"] = swa_rope_theta(c)
    if family.arch == gguf.MODEL_ARCH.PHI3:
        want[f"{a}.rope.dimension_count"] = rope_dimensions(c)
    if family.experts:
        want[f"{a}.expert_count"] = expert_count(c)
        want[f"{a}.expert_used_count"] = c["num_experts_per_tok"]
        if c.get("moe_intermediate_size") is not None:
            want[f"{a}.expert_feed_forward_length"] = c["moe_intermediate_size"]
    return want


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


def extra_tensors(config: dict, family: Family) -> dict[str, np.ndarray]:
    """Tensors llama.cpp takes that the model computes from its config: Llama 3's `rope_freqs`, Phi-3's long and
    short rope factors (both float32, as llama.cpp's converter writes them)."""
    out = {}
    freqs = rope_freqs(config)
    if freqs is not None:
        out[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"] = freqs
    rope = rope_parameters(config)
    if family.arch == gguf.MODEL_ARCH.PHI3 and rope.get("long_factor"):
        for key, tensor in (("long_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_LONG),
                            ("short_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)):  # fmt: skip
            out[gguf.TENSOR_NAMES[tensor] + ".weight"] = np.asarray(rope[key], dtype=np.float32)
    return out


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's rotary halves -> llama.cpp's interleaved pairs, per head (rows of a Q or K projection)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute`: llama.cpp's row order back to Hugging Face's."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class Transform:
    """How one tensor is stored: `to_gguf` on the Hugging Face values; `to_hf` its exact inverse where it only
    reorders rows (then the proof reads the file back through it, in Hugging Face order, independently of the
    writer), else None (the proof applies `to_gguf` to the source and compares in GGUF order); `shape` the shape
    stored."""

    to_gguf: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray] | None = None
    shape: Callable[[tuple[int, ...]], tuple[int, ...]] = lambda shape: shape


def transform(hf_name: str, config: dict, family: Family) -> Transform | None:
    """How this tensor is stored for llama.cpp, or None when it is stored as it is."""
    if family.transposed and hf_name.endswith(family.transposed):
        return Transform(lambda w: np.ascontiguousarray(w.T), None, lambda shape: tuple(reversed(shape)))
    if family.norm_plus_one and hf_name.endswith("norm.weight"):
        return Transform(lambda w: w + np.float32(1.0))
    if not family.permute_qk:
        return None
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        n = int(config["num_attention_heads"])
    elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        n = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    else:
        return None
    return Transform(lambda w: permute(w, n), lambda w: unpermute(w, n))


_EXPERT = re.compile(r"^(?P<layer>.*\.experts)\.(?P<expert>\d+)\.(?P<part>[^.]+)\.weight$")


def tensor_groups(names: Iterable[str], config: dict, family: Family, where: object) -> dict[str, tuple[str, ...]]:
    """The source tensors as the GGUF holds them, in order: each on its own (name -> (name,)), except a MoE layer's
    experts, stacked per projection into one tensor named as gguf's map knows it
    (`...experts.w1.weight` -> (`...experts.0.w1.weight`, `...experts.1.w1.weight`, ...)); an expert missing from
    a layer is named."""
    out: dict[str, tuple[str, ...]] = {}
    stacks: dict[str, dict[int, str]] = {}
    for name in names:
        match = _EXPERT.match(name) if family.experts else None
        if match is None:
            out[name] = (name,)
            continue
        key = f"{match['layer']}.{match['part']}.weight"
        out.setdefault(key, ())
        stacks.setdefault(key, {})[int(match["expert"])] = name
    n = expert_count(config) or 0
    for key, members in stacks.items():
        if sorted(members) != list(range(n)):
            raise BadInputError(f"{where}: {key} has experts {sorted(members)}, config.json says {n}",
                                file=where)  # fmt: skip
        out[key] = tuple(members[e] for e in range(n))
    return out


SKIPPED = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias", ".attn.masked_bias", ".attn.bias")


def gguf_name(hf_name: str, tmap: gguf.TensorNameMap, where: object) -> str:
    """gguf's own name for a Hugging Face tensor; a tensor with no place in the architecture is named."""
    name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise BadInputError(f"{where}: tensor {hf_name} has no place in a llama.cpp model of this architecture",
                            file=where, tensor=hf_name)  # fmt: skip
    return name
