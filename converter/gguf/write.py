"""The GGUF writer: header and metadata from the shapes first, then the tensors one at a time, into a temporary
file renamed into place only when complete.

Why streaming: a GGUF lists every tensor's name, type and offset before the data, and all of that follows from the
safetensors headers; so each tensor is read, transformed (Q/K rows), quantized and written before the next is read,
and memory holds one tensor whatever the model's size.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from converter.gguf import arch
from converter.gguf.source import Source
from converter.gguf.vocab import add_vocab

QTYPE = {
    "F32": gguf.GGMLQuantizationType.F32,
    "F16": gguf.GGMLQuantizationType.F16,
    "BF16": gguf.GGMLQuantizationType.BF16,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
}
FILE_TYPE = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
# llama.cpp keeps these in float32 whatever the file type (as its converter and its quantizer do)
ALWAYS_F32 = (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP, gguf.MODEL_TENSOR.POS_EMBD,
              gguf.MODEL_TENSOR.TOKEN_TYPES)  # fmt: skip


@dataclass(frozen=True)
class Planned:
    """One tensor of the file: where it comes from, its shape and type as stored, and how it is transformed."""

    name: str
    hf_name: str | None  # None: made from the config (arch.extra_tensors); stacked experts: gguf's name for them
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType
    transform: arch.Transform | None = None
    parts: tuple[str, ...] = ()  # the experts stacked into this tensor, in order (else empty)
    made: np.ndarray | None = field(default=None, compare=False)  # hf_name None: its values


def _stored_type(name: str, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType, block_count: int):
    keep_f32 = {gguf.TENSOR_NAMES[t].format(bid=b) + ".weight" for t in ALWAYS_F32 for b in range(block_count)}
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or name in keep_f32:
        return gguf.GGMLQuantizationType.F32
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block:  # as llama.cpp's converter does when a row does not split into blocks
        return gguf.GGMLQuantizationType.F16
    return qtype


def plan(source: Source, family: arch.Family, type_name: str) -> list[Planned]:
    """Every tensor of the file, in the order written; a tensor with no GGUF name is refused here, before writing."""
    config, n = source.config, arch.block_count(source.config)
    tmap = gguf.get_tensor_name_map(family.arch, n)
    out = []
    for name, data in arch.extra_tensors(config, family).items():
        out.append(Planned(name, None, data.shape, gguf.GGMLQuantizationType.F32, made=data))
    for hf_name, members in arch.tensor_groups(source.tensors, config, family, source.folder).items():
        if hf_name.endswith(arch.SKIPPED) or (family.tied_head and hf_name == family.tied_head[0]):
            continue
        name = arch.gguf_name(hf_name, tmap, source.folder)
        if members != (hf_name,):  # stacked experts
            shape = (len(members), *source.tensors[members[0]].shape)
            out.append(Planned(name, hf_name, shape, _stored_type(name, shape, QTYPE[type_name], n), parts=members))
            continue
        t = arch.transform(hf_name, config, family)
        shape = t.shape(source.tensors[hf_name].shape) if t else source.tensors[hf_name].shape
        out.append(Planned(name, hf_name, shape, _stored_type(name, shape, QTYPE[type_name], n), t))
    return out


def stored(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """The bytes (as gguf's arrays) of float32 `data` in `qtype`: gguf's reference quantizers."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return data.astype(np.float32, copy=False)
    return gguf.quants.quantize(data, qtype)


def tensor_data(source: Source, p: Planned) -> np.ndarray:
    """The float32 values of one planned tensor in GGUF row order (before quantization)."""
    if p.hf_name is None:
        return p.made
    if p.parts:
        return np.stack([source.read(part) for part in p.parts])
    data = source.read(p.hf_name)
    return p.transform.to_gguf(data) if p.transform else data


def write_gguf(source: Source, family: arch.Family, type_name: str, path: Path, *, name: str,
               pre: str | None = None) -> list[Planned]:  # fmt: skip
    """Write `path` (atomically: a temporary name beside it, renamed when complete). Returns the plan written."""
    tensors = plan(source, family, type_name)
    w = gguf.GGUFWriter(None, arch.arch_name(family))
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    arch.add_model_metadata(w, source.config, family)
    w.add_file_type(FILE_TYPE[type_name])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocab(w, source.folder, source.config, family, pre=pre)
    for p in tensors:
        nbytes = _nbytes(p.shape, p.qtype)
        w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), nbytes, raw_dtype=p.qtype)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for p in tensors:
            w.write_tensor_data(stored(tensor_data(source, p), p.qtype))
        w.close()
        os.replace(tmp, path)
    finally:
        w.close()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return tensors


def _nbytes(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape, dtype=np.int64)) // block * size
