"""bitsandbytes 4-bit checkpoints in transformers' own serialization, both ways.

Writing: `--dtype bnb-nf4|bnb-fp4` stores each linear weight as transformers' `save_pretrained` does after
`load_in_4bit` (packed codes, absmax, quant_map, nested_* for double quantization and a JSON blob
`quant_state.bitsandbytes__<type>`), so `from_pretrained` loads it with no extra arguments. Every component's
shape follows from the weight's shape, so headers stay final before data and the merge stays streaming.

Reading: a pre-quantized bitsandbytes base is dequantized into a plain checkpoint before merging.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from converter.engine.checkpoint import Checkpoint
from converter.engine.writer import OutSpec, ShardedWriter
from converter.errors import CheckpointError
from converter.io import dtypes
from converter.io.dtypes import CONFIG_NAME, FLOATING
from converter.io.lazy import torch

NESTED_BLOCKSIZE = 256  # bitsandbytes quantizes the absmax of double quantization in blocks of 256
STATE_PREFIX = "quant_state.bitsandbytes__"
# The JSON blob holds one float (nested_offset) whose text length varies; its tensor is sized for the longest
# float and padded with spaces (valid JSON whitespace), so its shape is known before the value is.
LONGEST_FLOAT = -1.2345678901234567e-300


@dataclass(frozen=True)
class Quant4:
    """The 4-bit settings of transformers' BitsAndBytesConfig(load_in_4bit=True, ...)."""

    quant_type: str = "nf4"
    blocksize: int = 64
    double_quant: bool = True

    def _state(self, shape: tuple[int, ...], dtype: str, offset: float) -> dict:
        state = {"quant_type": self.quant_type, "blocksize": self.blocksize, "dtype": CONFIG_NAME[dtype]}
        state["shape"] = list(shape)
        if self.double_quant:
            state.update(nested_blocksize=NESTED_BLOCKSIZE, nested_dtype="float32", nested_offset=offset)
        return state

    def components(self, name: str, shape: tuple[int, ...], dtype: str) -> list[OutSpec]:
        """The tensors that replace weight `name` (shape, dtype as loaded), in the order `pack` yields them."""
        numel = math.prod(shape)
        blocks = math.ceil(numel / self.blocksize)
        specs = [OutSpec(name, "U8", ((numel + 1) // 2, 1))]
        if self.double_quant:
            specs += [
                OutSpec(f"{name}.absmax", "U8", (blocks,)),
                OutSpec(f"{name}.nested_absmax", "F32", (math.ceil(blocks / NESTED_BLOCKSIZE),)),
                OutSpec(f"{name}.nested_quant_map", "F32", (256,)),
            ]
        else:
            specs.append(OutSpec(f"{name}.absmax", "F32", (blocks,)))
        blob = len(json.dumps(self._state(shape, dtype, LONGEST_FLOAT)))
        specs += [
            OutSpec(f"{name}.quant_map", "F32", (16,)),
            OutSpec(f"{name}.{STATE_PREFIX}{self.quant_type}", "U8", (blob,)),
        ]
        return specs

    def pack(self, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Quantize `w` (in the dtype it is stored and loaded in) exactly as transformers' loader does."""
        import bitsandbytes.functional as bnb

        codes, state = bnb.quantize_4bit(
            w.contiguous(), blocksize=self.blocksize, compress_statistics=self.double_quant, quant_type=self.quant_type
        )
        out = {name: codes, f"{name}.absmax": state.absmax}
        if self.double_quant:
            out[f"{name}.nested_absmax"] = state.state2.absmax
            out[f"{name}.nested_quant_map"] = state.state2.code
        out[f"{name}.quant_map"] = state.code
        offset = state.offset.item() if self.double_quant else 0.0
        dtype = dtypes.TORCH_TO_ST[w.dtype]
        text = json.dumps(self._state(tuple(w.shape), dtype, offset))
        size = self.components(name, tuple(w.shape), dtype)[-1].shape[0]
        blob = text.encode() + b" " * (size - len(text))
        out[f"{name}.{STATE_PREFIX}{self.quant_type}"] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        return out

    def config(self, compute_dtype: str, skipped: list[str]) -> dict:
        """`quantization_config` for config.json, as BitsAndBytesConfig.to_dict() writes it."""
        return {
            "_load_in_4bit": True,
            "_load_in_8bit": False,
            "bnb_4bit_compute_dtype": CONFIG_NAME[compute_dtype],
            "bnb_4bit_quant_storage": "uint8",
            "bnb_4bit_quant_type": self.quant_type,
            "bnb_4bit_use_double_quant": self.double_quant,
            "llm_int8_enable_fp32_cpu_offload": False,
            "llm_int8_has_fp16_weight": False,
            "llm_int8_skip_modules": skipped or None,
            "llm_int8_threshold": 6.0,
            "load_in_4bit": True,
            "load_in_8bit": False,
            "quant_method": "bitsandbytes",
        }


def parse_output(dtype: str | None) -> Quant4 | None:
    """`bnb-nf4` / `bnb-fp4` (the other 4-bit settings are transformers' defaults) or None for a float dtype."""
    if dtype and dtype.lower() in ("bnb-nf4", "bnb-fp4"):
        return Quant4(quant_type=dtype.lower().removeprefix("bnb-"))
    return None


def quantized_names(specs: list[OutSpec], skip: Callable[[str], bool]) -> set[str]:
    """Which output tensors are stored in 4 bits: 2-D floating `.weight`s of linear layers (not `skip`)."""
    return {
        s.name
        for s in specs
        if len(s.shape) == 2 and s.name.endswith(".weight") and s.dtype in FLOATING and not skip(s.name)
    }


class Quantizing4bitWriter:
    """A ShardedWriter whose `quantized` tensors arrive as usual (full precision) and are stored in 4 bits."""

    def __init__(
        self, folder: Path, specs: list[OutSpec], max_shard_bytes: int, quant: Quant4, quantized: set, on_shard=None
    ):
        self.quant = quant
        self.specs = {s.name: s for s in specs if s.name in quantized}
        expanded = []
        for s in specs:
            expanded += quant.components(s.name, s.shape, s.dtype) if s.name in quantized else [s]
        self.inner = ShardedWriter(folder, expanded, max_shard_bytes, on_shard=on_shard)

    def write(self, name: str, produce: Callable[[Callable[[bytes], None]], None]) -> None:
        spec = self.specs.get(name)
        if spec is None:
            self.inner.write(name, produce)
            return
        buf = bytearray()
        produce(buf.extend)
        w = torch.frombuffer(buf, dtype=torch.uint8).view(dtypes.ST_TO_TORCH[spec.dtype]).reshape(spec.shape)
        for part, t in self.quant.pack(name, w).items():
            data = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
            self.inner.write(part, lambda sink, d=data: sink(d))

    def close(self) -> list[str]:
        return self.inner.close()

    def abort(self) -> None:
        self.inner.abort()


def prequantized(config: dict) -> Quant4 | None:
    """The 4-bit settings of a bitsandbytes 4-bit checkpoint, None when it is not quantized; other
    quantizations (8-bit, GPTQ, AWQ ...) cannot be dequantized exactly here and are refused."""
    q = config.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") == "bitsandbytes" and q.get("load_in_4bit"):
        return Quant4(q.get("bnb_4bit_quant_type", "fp4"), 64, bool(q.get("bnb_4bit_use_double_quant")))
    raise CheckpointError(
        f"a pre-quantized ({q.get('quant_method', '?')}{' 8-bit' if q.get('load_in_8bit') else ''}) base cannot be "
        "dequantized exactly; merge into the original full-precision model it was made from (its card's base_model)"
    )


def dequantize_folder(src: Checkpoint, dst: Path) -> None:
    """Write `src` (a bitsandbytes 4-bit checkpoint) as a plain one into `dst`: each 4-bit weight dequantized
    into the dtype it was quantized from, one weight at a time; config.json without quantization_config."""
    import bitsandbytes.functional as bnb

    names = src.names()
    groups: dict[str, list[str]] = {}
    for n in names:
        owner = next((n[: -len(s)] for s in _COMPONENT_SUFFIXES if n.endswith(s) and n[: -len(s)] in src.where), None)
        if owner is None and any(n.endswith(s) for s in _COMPONENT_SUFFIXES):
            raise CheckpointError(
                f"{src.folder}: 4-bit component {n} has no weight {n.split('.weight.')[0]}.weight",
                file=src.folder,
                tensor=n,
            )
        if owner is not None:
            groups.setdefault(owner, []).append(n)
    specs, plain = [], []
    for n in names:
        if any(n in parts for parts in groups.values()):
            continue
        if n in groups:
            state = _state_of(src, n, groups[n])
            specs.append(OutSpec(n, dtypes.TORCH_TO_ST[state.dtype], tuple(state.shape)))
        else:
            specs.append(OutSpec(n, src.info(n).dtype, src.info(n).shape))
        plain.append(n)
    writer = ShardedWriter(dst, specs, 5 * 2**30)
    try:
        for n in plain:
            if n in groups:
                state = _state_of(src, n, groups[n])
                t = bnb.dequantize_4bit(src.read(n), state)
            else:
                t = src.read(n)
            data = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
            writer.write(n, lambda sink, d=data: sink(d))
    except BaseException:
        writer.abort()
        raise
    writer.close()
    for f in sorted(src.folder.iterdir()):  # tokenizer, generation config ...: everything but weights and config
        if f.is_file() and f.name != "config.json" and not f.name.endswith((".safetensors", ".index.json")):
            shutil.copyfile(f, dst / f.name)
    config = dict(src.config)
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


_COMPONENT_SUFFIXES = (
    ".absmax",
    ".nested_absmax",
    ".nested_quant_map",
    ".quant_map",
    f".{STATE_PREFIX}nf4",
    f".{STATE_PREFIX}fp4",
)


def _state_of(src: Checkpoint, name: str, parts: list[str]):
    from bitsandbytes.functional import QuantState

    try:
        return QuantState.from_dict({p[len(name) + 1 :]: src.read(p) for p in parts}, device=torch.device("cpu"))
    except (ValueError, KeyError, AssertionError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{src.folder}: 4-bit weight {name}: unreadable quantization state ({e})", file=src.folder, tensor=name
        ) from None
