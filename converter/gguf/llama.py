"""llama.cpp itself, through llama-cpp-python (the `converter[gguf]` extra): its tokenizer, its logits and its
quantizer, with its C-level logging silenced.

Why llama.cpp and not a re-implementation: the question a GGUF must answer is whether llama.cpp runs it as the
model ran in transformers; only llama.cpp can say. Its log lines (model loading, every decode) go through
`llama_log_set` to nothing; the CLI's -v shows them.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

import numpy as np

from converter.errors import BadInputError
from converter.io.optional import require

_keep: list = []  # the C callback must outlive every call into llama.cpp


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


@cache
def _llama_cpp(why: str = "llama.cpp's tokenizer, logits and K-quants"):
    llama_cpp = require("llama_cpp", why)
    if not os.environ.get("CONVERTER_LLAMA_LOG"):

        @llama_cpp.llama_log_callback
        def _silent(level, text, user_data):  # noqa: ARG001 - the C signature
            return None

        _keep.append(_silent)
        llama_cpp.llama_log_set(_silent, ctypes.c_void_p(0))
    return llama_cpp


def require_llama(why: str) -> None:
    """Fail early, in one line naming the extra, when llama-cpp-python is not installed."""
    _llama_cpp(why)


def _open(path: Path, **kwargs):
    llama_cpp = _llama_cpp()
    try:
        return llama_cpp.Llama(model_path=str(path), verbose=False, **kwargs)
    except ValueError as e:  # llama-cpp-python's words for "llama.cpp refused to load it"
        raise BadInputError(f"{path.name}: llama.cpp cannot load it ({e})", file=path) from None


def tokenizer(path: Path):
    """A vocab-only llama.cpp model: `.tokenize(bytes, add_bos=..., special=True)`."""
    return _open(path, vocab_only=True)


def logits(path: Path, prompts: list[list[int]], threads: int | None = None, lora: Path | None = None
           ) -> list[np.ndarray]:  # fmt: skip
    """llama.cpp's logits at every position of each prompt (token ids), one model load for all; with `lora`, that
    adapter GGUF applied at run time (scale 1)."""
    n_ctx = max(64, max(len(p) for p in prompts) + 8)
    options = dict(logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads or os.cpu_count())
    if lora is None:
        llm = _open(path, **options)
    else:
        try:
            llm = _llama_cpp().Llama(model_path=str(path), verbose=False, lora_path=str(lora), **options)
        except (ValueError, RuntimeError) as e:  # llama.cpp says why in its log (CONVERTER_LLAMA_LOG=1)
            raise BadInputError(f"{lora.name}: llama.cpp cannot apply it to {path.name} ({e})", file=lora) from None
    out = []
    try:
        for ids in prompts:
            llm.reset()
            llm.eval(ids)
            out.append(np.array(llm.scores[: len(ids)], dtype=np.float32))
    finally:
        llm.close()
    return out


def quantize(src: Path, dst: Path, type_name: str) -> None:
    """llama.cpp's own quantizer (llama_model_quantize), `src` (F32/F16 GGUF) -> `dst` in `type_name`."""
    llama_cpp = _llama_cpp(f"GGUF type {type_name}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_name}")
    params.nthread = os.cpu_count() or 1
    code = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if code != 0:
        raise BadInputError(f"{src.name}: llama.cpp's quantizer failed for {type_name} (code {code})", file=src)
