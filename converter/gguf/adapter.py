"""A LoRA adapter as a GGUF adapter file that llama.cpp applies at run time (`--lora`, `Llama(lora_path=...)`).

Why its own writer: llama.cpp loads an adapter GGUF beside a base GGUF and adds scale · B(A x) to each matrix
product of the base tensor it names. The file is the base's architecture name with `general.type = adapter`,
`adapter.type = lora` and one `adapter.lora.alpha`; then per base tensor `<name>.lora_a` (rank, in) and
`<name>.lora_b` (out, rank), where `<name>` is the base tensor's own GGUF name. llama.cpp computes the scale per
tensor as alpha / rank (the rank read from lora_b), so modules whose own alpha differs from the file's have the ratio
folded into lora_b. lora_b's rows are reordered exactly as the base tensor's are (the Llama line's Q/K `permute`),
since ΔW = B A shares W's rows. A LoRA on the token embeddings (PEFT's lora_embedding_A (rank, vocab) and
lora_embedding_B (dim, rank)) is looked up by token rather than multiplied: llama.cpp gathers one row of lora_a per
token and multiplies it by lora_b, so token_embd.weight.lora_a holds A transposed, (vocab, rank), and lora_b holds B
as it is; the scale is alpha / rank as for the others. The embedding PEFT saves beside such a LoRA is the base's own,
unchanged: it is checked equal to the base's and left out. What llama.cpp cannot apply from such a file (DoRA's
magnitude, bias deltas, whole replaced tensors, LoRA on MoE experts, an embedding LoRA where the output head is the
embeddings) is refused in one line before anything is written.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

from converter.conversion.names import BaseNames, collect
from converter.errors import BadInputError
from converter.formats import Adapter, AdapterPatch
from converter.formats.patches import DoRA, DoRARows, ExpertLowRank, LowRank, Replace, RowReplace
from converter.gguf import arch
from converter.gguf.fileio import Writer
from converter.gguf.quantize import stored
from converter.gguf.source import Source
from converter.gguf.write import FILE_TYPE, QTYPE, plan

#: the types an adapter GGUF is written in (llama.cpp's own converter offers the same four)
ADAPTER_TYPES = ("F32", "F16", "BF16", "Q8_0")


@dataclass(frozen=True)
class LoraPair:
    """One base tensor's LoRA as the file holds it: A (rank, in) and B (out, rank), float32, B in Hugging Face row
    order with the module's alpha folded in where it differs from the file's; `transform` reorders B's rows for
    llama.cpp (None: stored as it is)."""

    name: str  # the base tensor's GGUF name, e.g. blk.0.attn_q.weight
    hf_name: str  # the base tensor's Hugging Face name
    a: np.ndarray
    b: np.ndarray
    transform: arch.Transform | None
    source: str  # the module's name in the adapter, for messages
    embedding: bool = False  # the token embeddings' LoRA: lora_a is stored as token_rows(a)

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class AdapterPlan:
    alpha: float
    pairs: list[LoraPair]
    relaid: bool = False  # some modules were fused or split onto the base's tensors (Phi-3's qkv_proj from q/k/v)


def refuse_unappliable(adapter: Adapter, family: arch.Family) -> None:
    """What an adapter GGUF cannot carry, named in one line before anything is written (a LoRA's own kind first)."""
    if adapter.config.get("alora_invocation_tokens") or adapter.config.get("invocation_string"):
        raise BadInputError(f"{adapter.path}: an activated LoRA (aLoRA: active only after its invocation tokens) is "
                             "not converted to GGUF; nothing was written", file=adapter.path)  # fmt: skip
    reasons = [(rank, ap) for ap in adapter.patches if (rank := _unappliable(ap, family)) is not None]
    if reasons:
        rank, ap = min(reasons, key=lambda r: r[0])
        raise BadInputError(f"{adapter.path}: {ap.native or ap.module} {_WHY[rank]}; nothing was written",
                            file=adapter.path, tensor=ap.native or ap.module)  # fmt: skip


_WHY = (
    "is DoRA: llama.cpp applies plain LoRA only (it has no magnitude vector), so it cannot apply it",
    "is a LoRA on MoE expert weights, which this conversion does not write for llama.cpp",
    "is a Tucker (conv) LoRA, which has no place in a llama.cpp model",
    "has a bias delta (PEFT lora_bias): llama.cpp's LoRA adapters carry no bias",
    "carries whole tensors or token rows (PEFT modules_to_save / trainable tokens): a llama.cpp LoRA adapter can "
    "only add B·A to a base tensor; merge it instead (converter merge --gguf)",
)


def _unappliable(ap, family: arch.Family) -> int | None:
    """Which of _WHY applies to this patch, or None."""
    patch = ap.patch
    if isinstance(patch, DoRA | DoRARows):
        return 0
    if isinstance(patch, ExpertLowRank) or ap.either or (family.experts and ".experts." in ap.module):
        return 1
    if isinstance(patch, LowRank) and patch.mid is not None:
        return 2
    if ap.param != "weight":
        return 3
    if isinstance(patch, Replace | RowReplace):
        return 4
    return None


def _is_embedding(ap: AdapterPatch) -> bool:
    """PEFT's embedding LoRA: ΔW = (B A)ᵀ, (vocab, dim) from A (rank, vocab) and B (dim, rank)."""
    return isinstance(ap.patch, LowRank) and ap.patch.flip and ap.patch.mid is None


def without_saved_embeddings(adapter: Adapter, names: BaseNames, source: Source) -> Adapter:
    """The adapter less the embedding PEFT saves whole beside an embedding LoRA (`save_embedding_layers`) where it
    is the base's own, value for value: loading it changes nothing. One that differs (new or trained token rows)
    stays, and is refused as a whole tensor. Each such embedding is read whole, once."""
    embedded = {ap.module for ap in adapter.patches if _is_embedding(ap)}
    kept = []
    for ap in adapter.patches:
        if ap.module in embedded and isinstance(ap.patch, Replace) and _is_the_bases(ap, names, source):
            continue
        kept.append(ap)
    return adapter if len(kept) == len(adapter.patches) else replace(adapter, patches=kept)


def _is_the_bases(ap: AdapterPatch, names: BaseNames, source: Source) -> bool:
    """Whether a whole saved tensor equals the base tensor it lands on (one tensor, all of it), value for value."""
    places = names.places(ap)
    if len(places) != 1 or places[0].rows is not None or places[0].key not in source.tensors:
        return False
    key = places[0].key
    if tuple(ap.patch.value.shape) != source.tensors[key].shape:
        return False
    return bool(np.array_equal(ap.patch.value.load().numpy(), source.read(key)))


def token_rows(a: np.ndarray) -> np.ndarray:
    """An embedding LoRA's A (rank, vocab) as token_embd.weight.lora_a: one row of rank values per token, which
    llama.cpp gathers by token id before multiplying by lora_b."""
    return np.ascontiguousarray(a.T)


def plan_adapter(adapter: Adapter, source: Source, family: arch.Family, *, rank: int | None = None) -> AdapterPlan:
    """Every module of `adapter` as a (lora_a, lora_b) pair on a tensor of the base's GGUF; a module with no tensor
    there (a tied output head, another model) is named."""
    names = None
    if any(_is_embedding(ap) for ap in adapter.patches):
        names = BaseNames(source.folder)
        adapter = without_saved_embeddings(adapter, names, source)
    refuse_unappliable(adapter, family)
    names = names or BaseNames(source.folder)
    embeddings = {ap.native or ap.module for ap in adapter.patches if _is_embedding(ap)}
    # collect() reads an embedding LoRA's A and B like any other LoRA's; its transposed ΔW is token_rows' business
    patches = [replace(ap, patch=replace(ap.patch, flip=False)) if _is_embedding(ap) else ap for ap in adapter.patches]
    if family.transposed:  # GPT-2's Conv1D: PEFT's A (r, in) and B (out, r) are already llama.cpp's orientation
        patches = [replace(ap, stored_transposed=None) for ap in patches]
    modules, _ = collect(replace(adapter, patches=patches), names, "peft", rank=rank)
    if not modules:
        raise BadInputError(f"{adapter.path}: the adapter has no LoRA modules to write", file=adapter.path)
    config = source.config
    tmap = gguf.get_tensor_name_map(family.arch, arch.block_count(config))
    in_base = {p.name for p in plan(source, family, "F32")}  # headers only
    if embeddings and "output.weight" not in in_base:
        first = sorted(embeddings)[0]
        raise BadInputError(f"{adapter.path}: {first} is an embedding LoRA on a base whose output head is its token "
                             "embeddings (tied weights: one tensor, token_embd.weight, in its GGUF); llama.cpp would "
                             "apply the LoRA to the output head too, where its shapes do not fit (llama.cpp aborts); "
                             "merge it instead (converter merge --gguf); nothing was written",
                            file=adapter.path, tensor=first)  # fmt: skip
    alphas = Counter(float(m.alpha) for m in modules if m.alpha)
    alpha = alphas.most_common(1)[0][0] if alphas else 1.0
    pairs = []
    for m in modules:
        hf_name = f"{m.name}.weight"
        if m.down.dim() != 2 or m.up.dim() != 2:
            raise BadInputError(f"{adapter.path}: {m.source} is a convolution LoRA, which has no place in a "
                                 "llama.cpp model", file=adapter.path, tensor=m.source)  # fmt: skip
        name = arch.gguf_name(hf_name, tmap, adapter.path)
        if name not in in_base:
            why = " (its weights are tied to the token embeddings there)" if hf_name.endswith("lm_head.weight") else ""
            raise BadInputError(f"{adapter.path}: {m.source} targets {hf_name}, which the base's GGUF has no tensor "
                                 f"{name} for{why}; llama.cpp could not apply it; nothing was written",
                                file=adapter.path, tensor=m.source)  # fmt: skip
        a = m.down.float().numpy().astype(np.float32, copy=True)
        b = m.up.float().numpy().astype(np.float32, copy=True)
        if m.alpha != alpha:  # llama.cpp scales every tensor by the file's alpha / rank: the rest goes into B
            b = b * np.float32(m.alpha / alpha)
        t = arch.transform(hf_name, config, family) if family.permute_qk else None
        pairs.append(LoraPair(name, hf_name, a, b, t, m.source, embedding=m.source in embeddings))
    relaid = any("+" in m.source or m.source.endswith("]") for m in modules)  # conversion.modules: fuse / split
    return AdapterPlan(alpha, pairs, relaid)


def stored_type(shape: tuple[int, ...], type_name: str) -> gguf.GGMLQuantizationType:
    """The type a LoRA factor is stored in: the one asked for, F16 where its rows do not split into Q8_0's blocks
    (a lora_b of rank 8), as llama.cpp's converter falls back."""
    qtype = QTYPE[type_name]
    if shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return gguf.GGMLQuantizationType.F16
    return qtype


def stored_tensors(p: LoraPair) -> tuple[tuple[str, np.ndarray], tuple[str, np.ndarray]]:
    """(name, float32 values) of lora_a and lora_b as llama.cpp reads them (B's rows in its order)."""
    a = token_rows(p.a) if p.embedding else p.a
    b = p.transform.to_gguf(p.b) if p.transform else p.b
    return (f"{p.name}.lora_a", a), (f"{p.name}.lora_b", np.ascontiguousarray(b))


def write_adapter_gguf(planned: AdapterPlan, family: arch.Family, type_name: str, path: Path, *, name: str) -> None:
    """Write `path` atomically (a temporary name beside it, renamed when complete). Adapters are small: every
    tensor is held at once."""
    w = Writer(None, arch.arch_name(family))
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_name(name)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, planned.alpha)
    w.add_file_type(FILE_TYPE[type_name])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for p in planned.pairs:
        for tensor_name, data in stored_tensors(p):
            qtype = stored_type(data.shape, type_name)
            w.add_tensor(tensor_name, stored(data, qtype), raw_dtype=qtype)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    finally:
        w.close()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
