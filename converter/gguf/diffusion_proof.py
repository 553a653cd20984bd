"""The proof of a diffusion GGUF file, in three parts (converter.gguf.proof's FileProof and Part), each naming what
is wrong when it fails.

1. Metadata: the architecture name ComfyUI-GGUF accepts, the file type, and each reshaped tensor's
   `comfy.gguf.orig_shape` (an array of INT32, as ComfyUI-GGUF's loader requires) equal to the source's shape;
   none for a tensor kept as it was.
2. Tensors: every tensor of the source's denoiser is in the file and nothing else; each is stored as the rules
   say (converter.gguf.diffusion_arch), with its stored shape, and its bytes equal gguf's reference cast /
   quantization of the source tensor (bytes compared: no dequantization, no float comparison).
3. Behaviour: diffusers loads the file with its GGUF quantizer (`from_single_file(..., quantization_config=
   GGUFQuantizationConfig(...))`) and its output on seeded inputs is compared with its output from the source's
   tensors quantized by gguf's reference (gguf.quants.quantize) and handed to it as the values its dequantizer
   reads from those bytes, under the same config. Both runs compute with the same values where diffusers reads the
   file right (names, shapes, layers), so the limit is float32's, whatever the type and the model. How far the
   type's rounding moves the output from the merged model's (float32) is measured and reported beside it, not
   judged: it depends on the model (a tiny UNet moves ten times as far as a tiny Wan under Q8_0), and a fixed limit
   on it would fail right files.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import gguf
import numpy as np

from converter.gguf import diffusion_run
from converter.gguf.diffusion import DiffusionSource, Planned, encode
from converter.gguf.diffusion_arch import ORIG_SHAPE
from converter.gguf.proof import FileProof, Part
from converter.gguf.write import FILE_TYPE
from converter.io.same_bytes import same_bytes

# Relative RMS difference of diffusers' output from the GGUF file against its output from the source's tensors as
# gguf's reference quantizes them: the same values in both runs (measured: 0 on every family tested,
# docs/gguf-diffusion.md), so only the order of float32 operations may separate them; one tensor negated gives
# 0.036 and more.
BEHAVIOUR_LIMIT = 1e-4


def prove_metadata(reader: gguf.GGUFReader, src: DiffusionSource, plan: list[Planned], type_name: str) -> Part:
    def value(key: str):
        f = reader.get_field(key)
        return None if f is None else f.contents()

    want = {"general.architecture": src.arch.name, "general.file_type": int(FILE_TYPE[type_name])}
    for key, expected in want.items():
        if value(key) != expected:
            return Part("metadata", False, f"{key} is {value(key)!r}, expected {expected!r}")
    reshaped = 0
    for p in plan:
        f = reader.get_field(f"{ORIG_SHAPE}{p.name}")
        if p.stored == p.shape:
            if f is not None:
                return Part("metadata", False, f"{ORIG_SHAPE}{p.name} is set, but {p.name} is stored as it was")
            continue
        reshaped += 1
        int32 = [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
        if f is None or f.types != int32 or tuple(f.contents()) != p.shape:
            got = None if f is None else f.contents()
            return Part("metadata", False, f"{ORIG_SHAPE}{p.name} is {got!r}, {p.name}'s shape is {p.shape} "
                        "(an INT32 array)")  # fmt: skip
    extra = [f for f in reader.fields if f.startswith(ORIG_SHAPE) and f[len(ORIG_SHAPE) :] not in src.names.values()]
    if extra:
        return Part("metadata", False, f"{extra[0]} names no tensor of the file")
    how = f"; {reshaped} UNet tensors' original shapes recorded" if reshaped else ""
    return Part("metadata", True, f"architecture {src.arch.name}, file type {type_name}{how}")


def _read_back(data: np.ndarray, p: Planned):
    """The values diffusers computes with from the stored bytes `data`, at the source's shape: F32 and F16 as they
    are, the other types through its own dequantizer (Q8_0's in float16: its scale times the int8 values, rounded
    there); kept in the dtype they come in (float32 only where they are), widened by diffusers as it loads them."""
    import torch
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    t = torch.from_numpy(np.ascontiguousarray(data))
    if p.qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        t = dequantize_gguf_tensor(GGUFParameter(t, quant_type=p.qtype))
    return t.reshape(p.shape)


def rounded_source(src: DiffusionSource, plan: list[Planned]) -> dict:
    """The source's denoiser tensors quantized by gguf's reference to `plan`'s types and read back as diffusers
    does (`_read_back`), under the GGUF names."""
    from safetensors import safe_open

    with safe_open(src.file, framework="pt") as f:
        return {p.name: _read_back(encode(f.get_tensor(p.key).float().numpy(), p, gguf.quants.quantize), p)
                for p in plan}  # fmt: skip


def prove_tensors(reader: gguf.GGUFReader, src: DiffusionSource, plan: list[Planned], rounded: dict | None = None
                  ) -> Part:  # fmt: skip
    """Every tensor's type, shape and bytes against the source's, read again from the source file; `rounded`, if
    given, receives each source tensor as gguf's reference quantizes it, read back (`rounded_source`, computed once
    for both parts)."""
    from safetensors import safe_open

    found = {t.name: t for t in reader.tensors}
    expected = {p.name for p in plan}
    with safe_open(src.file, framework="pt") as f:
        for p in plan:
            t = found.get(p.name)
            if t is None:
                return Part("tensors", False, f"{p.name} ({p.key}) is missing from the file")
            if t.tensor_type != p.qtype:
                return Part("tensors", False, f"{p.name} is stored as {t.tensor_type.name}, expected {p.qtype.name}")
            shape = tuple(int(d) for d in reversed(t.shape))
            if shape != p.stored:
                return Part("tensors", False, f"{p.name} has shape {shape}, expected {p.stored}")
            want = encode(f.get_tensor(p.key).float().numpy(), p, gguf.quants.quantize)
            if rounded is not None:
                rounded[p.name] = _read_back(want, p)
            got = np.ascontiguousarray(t.data).view(np.uint8).ravel()
            if got.size != want.nbytes or not same_bytes(got, np.ascontiguousarray(want).view(np.uint8).ravel()):
                return Part("tensors", False, f"{p.name} ({p.key}): its bytes differ from the source as "
                            f"{p.qtype.name}")  # fmt: skip
    extra = sorted(set(found) - expected)
    if extra:
        return Part("tensors", False, f"{extra[0]} is in the file but comes from no source tensor")
    kinds = sorted({p.qtype.name for p in plan})
    return Part("tensors", True, f"{len(plan)} tensors ({', '.join(kinds)}) equal to the source as cast / "
                "reference-quantized")  # fmt: skip


class Reference:
    """The merged single file's output in diffusers (float32) on the seeded inputs, computed once for every file;
    `why` says why there is none (the architecture has no run here, or diffusers could not read the source)."""

    def __init__(self, src: DiffusionSource):
        self.src, self.output, self.why = src, None, ""
        self._dir = tempfile.TemporaryDirectory(prefix="converter-gguf-config-")
        self.folder = Path(self._dir.name)
        shapes = {n: src.shapes[k] for k, n in src.names.items()}
        self.config = diffusion_run.config(src.arch.name, shapes, self.folder)
        if self.config is None:
            self.why = diffusion_run.reason(src.arch.name, shapes)
            return
        if too_large := _too_large(src):
            self.why = too_large
            return
        try:
            tensors = diffusion_run.denoiser(src.file, src.names)
            self.output = diffusion_run.outputs(src.arch.name, tensors, self.config, self.folder, gguf=False)
        except Exception as e:  # noqa: BLE001 (the source, not the file, is what diffusers cannot read)
            self.why = f"diffusers cannot run the source single file: {str(e).splitlines()[0][:200]}"

    def close(self) -> None:
        self._dir.cleanup()


def _too_large(src: DiffusionSource) -> str | None:
    """Why the reference cannot run here: diffusers holds the source's denoiser tensors and the model in float32 at
    once (a 12 B transformer: about 72 GB), and a run that exhausts memory would end the whole job; None if it fits.
    The 20% spare is for the activations and the allocator."""
    from converter.io.memory import available_memory

    elements = sum(math.prod(shape) for shape in src.shapes.values())
    need = int(1.2 * (4 * elements + min(src.file.stat().st_size, 4 * elements)))
    have = available_memory()
    if need <= have:
        return None
    return (f"diffusers' run of the merged denoiser in float32 needs about {need / 2**30:.1f} GiB of memory and "
            f"{have / 2**30:.1f} GiB are available here: not run (the tensors part, bit for bit, stands)")  # fmt: skip


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def prove_behaviour(path: Path, ref: Reference, type_name: str, rounded: dict | None = None) -> Part:
    """diffusers' output from the file against its output from the source as gguf's reference quantizes it
    (`rounded`, else computed here; emptied once used), and the type's own distance from the merged model's
    output, reported."""
    if ref.output is None:
        return Part("behaviour", True, ref.why, judged=False)
    if not rounded:
        rounded = rounded_source(ref.src, ref.src.plan(type_name))
    want = diffusion_run.outputs(ref.src.arch.name, rounded, ref.config, ref.folder, gguf=False)
    rounded.clear()  # freed before the file's model is built (the caller's dict too)
    try:
        got = diffusion_run.outputs(ref.src.arch.name, path, ref.config, ref.folder, gguf=True)
    except Exception as e:  # noqa: BLE001 (diffusers refusing the file is the finding)
        return Part("behaviour", False, f"diffusers cannot load the file: {str(e).splitlines()[0][:200]}")
    if got.shape != want.shape or not np.isfinite(got).all():
        return Part("behaviour", False, f"diffusers' output from the file has shape {got.shape} or is not finite")
    rel = _relative(got, want)
    return Part("behaviour", rel <= BEHAVIOUR_LIMIT, f"diffusers' output from the file differs from its output "
                f"from the merged tensors as gguf quantizes them to {type_name} by {rel:.2g} (relative RMS; limit "
                f"{BEHAVIOUR_LIMIT}); {type_name} moves it {_relative(want, ref.output):.2g} from the merged "
                "model's float32 output")  # fmt: skip


def prove(path: Path, src: DiffusionSource, type_name: str, ref: Reference) -> FileProof:
    """All three parts, each run only if the ones before it passed."""
    fp = FileProof(path.name, type_name)
    plan = src.plan(type_name)
    reader = gguf.GGUFReader(path)
    fp.parts.append(prove_metadata(reader, src, plan, type_name))
    rounded = {} if ref.output is not None else None
    if fp.passed:
        fp.parts.append(prove_tensors(reader, src, plan, rounded))
    del reader
    if fp.passed:
        fp.parts.append(prove_behaviour(path, ref, type_name, rounded))
    return fp
