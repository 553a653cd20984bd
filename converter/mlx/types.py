"""The MLX types a user can ask for, named as mlx-community names its repos (`<model>-4bit`, `-8bit`, `-bf16`).

Why these three: they are what `mlx_lm.convert` makes with its defaults (`-q` with 4 or 8 bits, affine, groups of
64) and with `--dtype bfloat16`, and what people look for on the Hub.
"""

from __future__ import annotations

from dataclasses import dataclass

from converter.errors import UsageError


@dataclass(frozen=True)
class MLXType:
    name: str  # the folder and repo suffix
    bits: int | None  # None: not quantized
    group_size: int = 64
    mode: str = "affine"
    dtype: str | None = None  # cast every floating tensor to this first (mlx-lm's --dtype)


TYPES = {
    "4bit": MLXType("4bit", 4),
    "8bit": MLXType("8bit", 8),
    "bf16": MLXType("bf16", None, dtype="bfloat16"),
}


def parse_types(text: str) -> list[MLXType]:
    """`4bit,BF16` -> [4bit, bf16] (in order, once each); an unknown name is a usage error."""
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if not names:
        raise UsageError(f"--mlx {text!r}: name at least one of {', '.join(TYPES)}")
    for name in names:
        if name not in TYPES:
            raise UsageError(f"--mlx: unknown type {name!r}; choose from {', '.join(TYPES)} (comma-separated)")
    return [TYPES[n] for n in dict.fromkeys(names)]
