"""safetensors dtype names <-> torch dtypes, and user-facing dtype names.

The torch tables are built on first use (module __getattr__): the torch-free merge path needs only ITEMSIZE.
"""

from __future__ import annotations

from functools import cache

from converter.errors import UsageError

ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
TORCH_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64",
    "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


@cache
def _torch_tables() -> tuple[dict, dict]:
    import torch

    st_to_torch = {name: getattr(torch, t) for name, t in TORCH_NAMES.items()}
    return st_to_torch, {v: k for k, v in st_to_torch.items()}


def __getattr__(name: str):
    """ST_TO_TORCH / TORCH_TO_ST: safetensors name <-> torch.dtype, importing torch only when asked for."""
    if name == "ST_TO_TORCH":
        return _torch_tables()[0]
    if name == "TORCH_TO_ST":
        return _torch_tables()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
        raise UsageError(
            f"unknown dtype {name!r}: use one of float32, float16, bfloat16 (or leave it out to keep the base's)"
        ) from None
