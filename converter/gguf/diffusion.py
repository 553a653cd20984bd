"""A diffusion model's single-file checkpoint (its denoiser: a transformer or a UNet) written as GGUF files, one per
type, in one pass over the source.

Why from the single file: ComfyUI-GGUF's loaders and diffusers' GGUF loader both read the original single-file
layout (BFL's Flux keys, Wan's own, the ldm UNet's), so the file written is the source's tensors under the same
names (a full checkpoint's `model.diffusion_model.` prefix removed), each stored as the architecture's rules say
(converter.gguf.diffusion_arch) and quantized by gguf's reference quantizers. Each source tensor is read once,
in float32, and goes into every requested file before the next is read: memory is one tensor, whatever the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from converter.errors import BadInputError, UsageError
from converter.gguf.diffusion_arch import MAX_NAME, ORIG_SHAPE, DiffusionArch, denoiser_keys, detect
from converter.gguf.diffusion_arch import stored_shape as _stored_shape
from converter.gguf.diffusion_arch import stored_type as _stored_type
from converter.gguf.quantize import stored
from converter.gguf.write import FILE_TYPE, QTYPE

TYPES = ("F32", "F16", "BF16", "Q8_0")  # what gguf's reference quantizers make exactly
FLOATS = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


@dataclass(frozen=True)
class Planned:
    key: str  # in the source file
    name: str  # in the GGUF file
    shape: tuple[int, ...]  # the source's
    stored: tuple[int, ...]  # in the GGUF (a UNet's reshape)
    qtype: gguf.GGMLQuantizationType


@dataclass(frozen=True)
class DiffusionSource:
    """A single-file checkpoint's denoiser, from its header: architecture, names and shapes."""

    file: Path
    arch: DiffusionArch
    names: dict[str, str]  # key in the file -> name in the GGUF
    shapes: dict[str, tuple[int, ...]]
    left_out: int  # keys outside the denoiser (a VAE, text encoders) or training state

    def plan(self, type_name: str) -> list[Planned]:
        wanted = QTYPE[type_name]
        return [Planned(k, n, self.shapes[k], _stored_shape(self.shapes[k], self.arch),
                        _stored_type(n, self.shapes[k], self.arch, wanted)) for k, n in self.names.items()]  # fmt: skip

    def read(self, key: str) -> np.ndarray:
        """One tensor, as float32 (bf16 and float8 widened exactly)."""
        from safetensors import safe_open

        with safe_open(self.file, framework="pt") as f:
            return f.get_tensor(key).float().numpy()


def single_file(spec: str | Path) -> Path | None:
    """The single-file checkpoint `spec` names: a .safetensors file, or a folder holding exactly one with no
    config.json or model_index.json beside it (what a merge into a single file writes); None otherwise."""
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".safetensors":
        return path
    if not path.is_dir() or (path / "config.json").exists() or (path / "model_index.json").exists():
        return None
    files = sorted(path.glob("*.safetensors"))
    return files[0] if len(files) == 1 else None


def is_diffusion_folder(spec: str | Path) -> bool:
    """A diffusers pipeline folder (model_index.json): its denoiser is in diffusers' layout."""
    return (Path(spec).expanduser() / "model_index.json").is_file()


def check_types(types: list[str], what: object) -> None:
    """Only the types gguf's reference quantizers make exactly; the K-quants need ComfyUI-GGUF's patched
    llama-quantize, whose output nothing here could check byte for byte."""
    other = [t for t in types if t not in TYPES]
    if other:
        raise UsageError(f"--gguf {other[0]} for {what}: a diffusion model's GGUF is written as {', '.join(TYPES)} "
                         "(K-quants are made by ComfyUI-GGUF's patched llama-quantize, which converter cannot "
                         "reproduce exactly)")  # fmt: skip


def open_source(file: Path) -> DiffusionSource:
    """The header of `file`, its denoiser's keys and architecture; bad input refused in one line naming it."""
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        keys = list(f.keys())
        meta = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in keys}
    names = denoiser_keys(keys)
    arch = detect(set(names.values()), file)
    kept = {k: n for k, n in names.items() if not any(s in n for s in arch.skip)}
    for k, n in kept.items():
        if meta[k][0] not in FLOATS:
            raise BadInputError(f"{file}: {k} is {meta[k][0]}; a denoiser's GGUF holds float tensors only",
                                file=file, tensor=k)  # fmt: skip
        if len(n) > MAX_NAME:
            raise BadInputError(f"{file}: {n} is longer than the {MAX_NAME} characters ggml reads", file=file,
                                tensor=k)  # fmt: skip
    shapes = {k: meta[k][1] for k in kept}
    return DiffusionSource(file, arch, kept, shapes, len(keys) - len(kept))


def _header(path: Path, src: DiffusionSource, type_name: str, plan: list[Planned], name: str) -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(path, src.arch.name)
    w.add_name(name)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(FILE_TYPE[type_name])
    for p in plan:
        if p.stored != p.shape:
            w.add_array(f"{ORIG_SHAPE}{p.name}", [int(d) for d in p.shape])
    for p in plan:
        nbytes = int(np.prod(gguf.quant_shape_to_byte_shape(p.stored, p.qtype)))
        w.add_tensor_info(p.name, p.stored, np.dtype(np.float32), nbytes, raw_dtype=p.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    return w


def encode(data: np.ndarray, p: Planned, quantize=stored) -> np.ndarray:
    """A source tensor (float32) as the file stores it: reshaped, then cast / quantized as gguf's reference does
    (converter.gguf.quantize; the proof passes gguf.quants.quantize itself)."""
    data = np.ascontiguousarray(data, dtype=np.float32).reshape(p.stored)
    return quantize(data, p.qtype)


def write(src: DiffusionSource, paths: dict[str, Path], name: str) -> None:
    """Every file of `paths` ({type: path}) in one pass over the source, one tensor in memory at a time."""
    from safetensors import safe_open

    plans = {t: src.plan(t) for t in paths}
    writers: dict[str, gguf.GGUFWriter] = {}
    try:
        for t, path in paths.items():
            writers[t] = _header(path, src, t, plans[t], name)
        with safe_open(src.file, framework="pt") as f:
            for i, key in enumerate(src.names):
                data = f.get_tensor(key).float().numpy()
                for t, w in writers.items():
                    w.write_tensor_data(encode(data, plans[t][i]))
    finally:
        for w in writers.values():
            w.close()


def describe(src: DiffusionSource) -> str:
    """One line for the log: what was recognised."""
    out = f"{src.file.name}: {src.arch.name}, {len(src.names)} tensors"
    return out + (f" ({src.left_out} outside the denoiser left out)" if src.left_out else "")
