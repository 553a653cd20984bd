"""safetensors dtype names <-> torch dtypes, and user-facing dtype names."""

from __future__ import annotations

import torch

from converter.errors import ConverterError

ST_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
TORCH_TO_ST = {v: k for k, v in ST_TO_TORCH.items()}
ITEMSIZE = {name: torch.empty((), dtype=dt).element_size() for name, dt in ST_TO_TORCH.items()}
FLOATING = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}

# Names accepted by --dtype and written to config.json ("dtype" in transformers 5).
USER_DTYPES = {
    "float32": "F32",
    "fp32": "F32",
    "float16": "F16",
    "fp16": "F16",
    "bfloat16": "BF16",
    "bf16": "BF16",
}
CONFIG_NAME = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def parse_user_dtype(name: str | None) -> str | None:
    """Map a user dtype name to a safetensors dtype, or None to keep each tensor's own dtype."""
    if name in (None, "", "auto", "keep"):
        return None
    try:
        return USER_DTYPES[name.lower()]
    except KeyError:
        raise ConverterError(
            f"unknown dtype {name!r}: use one of float32, float16, bfloat16 (or leave it out to keep the base's)"
        ) from None
