"""An MLX folder written as mlx-lm writes it, one tensor at a time.

Why our own writer: mlx-lm's `save_model` holds the whole model (a shard of up to 5 GB) in memory and writes it at
once. The layout (converter.mlx.layout) gives every name, dtype and shape first, so each file's header is final
before its data and each tensor is read from the merged folder, cast or quantized by mlx (`mx.quantize`, the
runtime's own quantizer) and written before the next is read. The files are what mlx-lm writes: the same tensors,
`{"format": "mlx"}` in each header, model.safetensors.index.json (always, with total_parameters), config.json
through mlx-lm's own `save_config`, the tokenizer saved by mlx-lm's tokenizer wrapper, generation_config.json and
any *.py copied.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from converter.io.safetensors_header import encode_header, entry
from converter.mlx import runtime
from converter.mlx.layout import MX_NAME, Layout, OutTensor

INDEX = "model.safetensors.index.json"
NUMPY = {"F32": np.float32, "F16": np.float16, "U32": np.uint32, "U8": np.uint8, "I32": np.int32, "I64": np.int64,
         "U16": np.uint16, "I8": np.int8, "BOOL": np.bool_}  # fmt: skip


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


class Tensors:
    """The layout's tensors made from the merged folder's, one module held at a time (a quantized module's three
    parts come from one `mx.quantize`)."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self._held: tuple[str, tuple, dict] | None = None  # (source, quant, parts)
        # a quantized module's float dtype: its scales' (mlx-lm casts the weight, then quantizes it)
        self._float = {t.name.rpartition(".")[0]: t.dtype for t in layout.tensors if t.quant and t.part == "scales"}

    def source(self, name: str):
        """A tensor of the merged folder as an mlx array."""
        mx, _ = runtime.require("MLX export")
        f, info = self.layout.sources[name]
        raw = f.read_bytes(name)
        if info.dtype == "BF16":
            return mx.array(raw.view(np.uint16)).view(mx.bfloat16).reshape(info.shape)
        return mx.array(raw.view(NUMPY[info.dtype])).reshape(info.shape)

    def make(self, t: OutTensor):
        """The output tensor `t` as an mlx array (evaluated)."""
        mx, _ = runtime.require("MLX export")
        dtype = getattr(mx, MX_NAME[t.dtype if t.quant is None else self._float[t.name.rpartition(".")[0]]])
        if t.quant is None:
            value = self.source(t.source)
            value = value if value.dtype == dtype else value.astype(dtype)
            mx.eval(value)
            return value
        if self._held is None or self._held[:2] != (t.source, t.quant):
            w = self.source(t.source)
            w = w if w.dtype == dtype else w.astype(dtype)
            group_size, bits, mode = t.quant
            parts = mx.quantize(w, group_size=group_size, bits=bits, mode=mode)
            mx.eval(*parts)
            self._held = (t.source, t.quant, dict(zip(("weight", "scales", "biases"), parts, strict=False)))
        return self._held[2][t.part]


def as_bytes(value) -> memoryview:
    """An evaluated mlx array's bytes, in safetensors order (row-major, little-endian)."""
    mx, _ = runtime.require("MLX export")
    if value.dtype == mx.bfloat16:
        value = value.view(mx.uint16)
    return memoryview(np.ascontiguousarray(np.array(value, copy=False))).cast("B")


def write_weights(layout: Layout, out: Path, log: Callable[[str], None] = print) -> list[str]:
    """The safetensors files and their index into `out`; returns the file names."""
    by_name = {t.name: t for t in layout.tensors}
    names = shard_names(len(layout.shards))
    tensors = Tensors(layout)
    weight_map = {}
    for file_name, shard in zip(names, layout.shards, strict=True):
        header, offset = {}, 0
        for name in shard:
            t = by_name[name]
            header[name] = entry(t.dtype, t.shape, offset, offset + t.nbytes)
            offset += t.nbytes
        with open(out / file_name, "wb") as f:
            f.write(encode_header(header, {"format": "mlx"}))
            for name in shard:
                data = as_bytes(tensors.make(by_name[name]))
                if len(data) != by_name[name].nbytes:
                    raise AssertionError(f"{name}: {len(data)} bytes made, {by_name[name].nbytes} planned")
                f.write(data)
                weight_map[name] = file_name
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in layout.tensors), "total_parameters": layout.total_parameters},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out / INDEX).write_text(json.dumps(index, indent=4))
    return [*names, INDEX]


def write_folder(layout: Layout, source: Path, out: Path, log: Callable[[str], None] = print) -> list[str]:
    """Weights, config.json, tokenizer and side files, as mlx-lm's `save` writes them; returns the file names."""
    _, lm = runtime.require("MLX export")
    files = write_weights(layout, out, log)
    lm.save_config(copy.deepcopy(layout.config), config_path=out / "config.json")
    before = set(p.name for p in out.iterdir())
    with runtime.quietly():
        lm.load_tokenizer(source).save_pretrained(out)
    for pattern in ("*.py", "generation_config.json"):
        for path in source.glob(pattern):
            shutil.copy(path, out / path.name)
    return sorted({*files, "config.json", *(p.name for p in out.iterdir() if p.name not in before)})
