"""The GGUF types a user can ask for: which we write in Python, which llama.cpp's quantizer makes.

Why: F32 / F16 / BF16 / Q8_0 have reference quantizers in the `gguf` package (Q8_0 bit-exact with ggml's), so
they need nothing but Python; the K-quants exist only in llama.cpp's C code (llama-cpp-python, an extra).
"""

from __future__ import annotations

from converter.errors import UsageError

#: written by us, through gguf.quants (name -> gguf.GGMLQuantizationType / LlamaFileType member name)
PYTHON_TYPES = ("F32", "F16", "BF16", "Q8_0")
#: made by llama.cpp's llama_model_quantize from our verified F32 file (name -> LLAMA_FTYPE_MOSTLY_* suffix)
#: (the ones whose proof thresholds were measured: converter.gguf.proof.BEHAVIOUR_LIMIT)
LLAMA_TYPES = ("Q4_0", "Q4_K_S", "Q4_K_M", "Q5_0", "Q5_K_S", "Q5_K_M", "Q6_K")
ALL_TYPES = PYTHON_TYPES + LLAMA_TYPES


def parse_types(text: str) -> list[str]:
    """`Q8_0,q4_k_m` -> ["Q8_0", "Q4_K_M"] (in order, once each); an unknown name is a usage error."""
    wanted: list[str] = []
    for part in text.split(","):
        name = part.strip().upper()
        if not name:
            continue
        if name not in ALL_TYPES:
            raise UsageError(f"GGUF type {part.strip()!r} is not one we make: {', '.join(ALL_TYPES)}")
        if name not in wanted:
            wanted.append(name)
    if not wanted:
        raise UsageError(f"give at least one GGUF type: {', '.join(ALL_TYPES)}")
    return wanted


def needs_llama(types: list[str]) -> bool:
    return any(t in LLAMA_TYPES for t in types)


def written_in_python(types: list[str]) -> list[str]:
    """The files we write for `types`: those of PYTHON_TYPES asked for, and F32 first when a K-quant is (llama.cpp's
    quantizer makes it from our proven F32 file)."""
    wanted = [t for t in types if t in PYTHON_TYPES]
    return ["F32", *wanted] if needs_llama(types) and "F32" not in wanted else wanted
