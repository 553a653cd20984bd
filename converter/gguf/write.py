"""The GGUF writer: header and metadata from the shapes first, then the tensors one at a time, into a temporary
file renamed into place only when complete.

Why streaming: a GGUF lists every tensor's name, type and offset before the data, and all of that follows from the
safetensors headers; so each tensor is read, transformed (Q/K rows), quantized and written before the next is read,
and memory holds one tensor whatever the model's size.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from converter.gguf import arch
from converter.gguf.fileio import Writer
from converter.gguf.quantize import stored
from converter.gguf.source import Source
from converter.gguf.vocab import vocab_metadata

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


def digest(data: np.ndarray) -> bytes:
    """SHA-256 of an array's bytes (C order): what the tensor proof compares the file's bytes with."""
    return hashlib.sha256(memoryview(np.ascontiguousarray(data)).cast("B")).digest()


@dataclass(frozen=True)
class Written:
    """A file written from a source (during a merge: converter.gguf.stream), and for each source tensor it holds
    as written (not stacked, rows at most reordered), the SHA-256 of gguf's reference cast / quantization of it in
    Hugging Face row order (converter.gguf.proof.prove_tensors reads the file back against these)."""

    path: Path
    digests: dict[str, bytes]


def gguf_layout(p: Planned, data: np.ndarray) -> np.ndarray:
    """One source tensor (float32) as llama.cpp stores it: Q/K rows reordered, norms shifted, Conv1D transposed."""
    return p.transform.to_gguf(data) if p.transform else data


class GGUFFile:
    """One GGUF file being written: its header (metadata, every tensor's name, type and offset) first, then each
    tensor at its offset as it arrives, in any order; renamed into place by `finish` once every tensor is there.

    Why any order: during a merge (converter.gguf.stream) tensors arrive in the base's file order and the experts of
    a MoE layer one by one; each goes straight to its place (an expert to its slice of the stacked tensor: every
    type we write quantizes row by row, so a slice's bytes are those of the whole), so nothing is held back."""

    def __init__(self, source: Source, family: arch.Family, type_name: str, path: Path, *, name: str,
                 vocab: dict[str, gguf.GGUFValue]):  # fmt: skip
        self.path = path
        self.planned = plan(source, family, type_name)
        w = Writer(None, arch.arch_name(family))
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(name)
        arch.add_model_metadata(w, source.config, family)
        w.add_file_type(FILE_TYPE[type_name])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, value in vocab.items():
            w.add_key_value(key, value.value, value.type, sub_type=value.sub_type)
        for p in self.planned:
            w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), _nbytes(p.shape, p.qtype), raw_dtype=p.qtype)
        self._tmp, self._fd = path.with_name(f".{path.name}.partial"), None
        try:
            self._open(w)
        except BaseException:
            self.abort()
            raise

    def _open(self, w: gguf.GGUFWriter) -> None:
        try:
            w.write_header_to_file(path=self._tmp)
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            w.flush()
            offset = gguf.GGUFWriter.ggml_pad(w.fout[0].tell(), w.data_alignment)
        finally:
            w.close()
        # where each source tensor goes: (planned tensor, byte offset); the padding between tensors stays zeros
        self._places: dict[str, tuple[Planned, int]] = {}
        made = []
        for p in self.planned:
            if p.hf_name is None:
                made.append((p, offset))
            elif p.parts:
                step = _nbytes(p.shape[1:], p.qtype)
                self._places.update({part: (p, offset + i * step) for i, part in enumerate(p.parts)})
            else:
                self._places[p.hf_name] = (p, offset)
            offset += gguf.GGUFWriter.ggml_pad(_nbytes(p.shape, p.qtype), w.data_alignment)
        self.digests: dict[str, bytes] = {}  # see Written
        self.needed = tuple(self._places)  # the source tensors this file is made of (a tied head is not)
        self._missing = set(self._places)
        self._fd = os.open(self._tmp, os.O_WRONLY)
        os.ftruncate(self._fd, offset)
        for p, at in made:
            self._write(stored(p.made, p.qtype), at)

    def wants(self, hf_name: str) -> bool:
        return hf_name in self._places

    def put(self, hf_name: str, data: np.ndarray) -> None:
        """Write one source tensor (float32, Hugging Face's layout) to its place. Where llama.cpp only reorders its
        rows (or keeps it as it is), it is cast / quantized in Hugging Face's row order, its digest kept, and its rows
        reordered after: every type we write stores a row as whole blocks, so the bytes are those of quantizing the
        reordered tensor, and the proof can check the reorder on the file alone. A change of values (a norm's shift,
        a transpose) is made before: the proof makes it again from the source."""
        p, offset = self._places[hf_name]
        if p.parts or p.transform is None or p.transform.to_hf is not None:
            data = stored(data, p.qtype)
            self.digests[hf_name] = digest(data)
            data = data if p.parts else gguf_layout(p, data)
        else:
            data = stored(gguf_layout(p, data), p.qtype)
        self._write(data, offset)
        self._missing.discard(hf_name)

    def _write(self, data: np.ndarray, offset: int) -> None:
        view = memoryview(np.ascontiguousarray(data)).cast("B")
        while view:
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n

    def finish(self) -> None:
        """Every tensor written: the file goes into place. A tensor that never came is a bug upstream."""
        if self._missing:
            self.abort()
            raise AssertionError(f"{self.path.name}: {sorted(self._missing)[0]} was never written")
        os.close(self._fd)
        self._fd = None
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with contextlib.suppress(FileNotFoundError):
            self._tmp.unlink()


def write_ggufs(source: Source, family: arch.Family, paths: dict[str, Path], *, name: str,
                pre: str | None = None, digests: dict[str, dict[str, bytes]] | None = None
                ) -> dict[str, list[Planned]]:  # fmt: skip
    """Write a file per type (`paths`: type -> file) in one pass over `source`: each tensor read once for all of
    them, the tokenizer's metadata made once, one tensor in memory at a time; each file atomically (a temporary name
    beside it, renamed when complete), and none of them if one fails. Returns the plan written, per type; fills
    `digests` (type -> Written.digests) when given."""
    vocab = vocab_metadata(source.folder, source.config, family, pre=pre)
    files: list[GGUFFile] = []
    finished: list[Path] = []
    try:
        for type_name, path in paths.items():
            files.append(GGUFFile(source, family, type_name, path, name=name, vocab=vocab))
        for hf_name in dict.fromkeys(n for f in files for n in f.needed):
            data = source.read(hf_name)
            for f in files:
                if f.wants(hf_name):
                    f.put(hf_name, data)
        for f in files:
            f.finish()
            finished.append(f.path)
        if digests is not None:
            digests.update({t: f.digests for t, f in zip(paths, files, strict=True)})
    except BaseException:
        for f in files:
            f.abort()
        for path in finished:
            path.unlink()
        raise
    return {t: f.planned for t, f in zip(paths, files, strict=True)}


def write_gguf(source: Source, family: arch.Family, type_name: str, path: Path, *, name: str,
               pre: str | None = None) -> list[Planned]:  # fmt: skip
    """One type's file (write_ggufs)."""
    return write_ggufs(source, family, {type_name: path}, name=name, pre=pre)[type_name]


def _nbytes(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape, dtype=np.int64)) // block * size
