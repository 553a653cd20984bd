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
    adapter GGUF applied at run time (scale 1). Without one, all prompts go in one decode (`_one_batch`)."""
    if lora is None and len(prompts) > 1:
        return _one_batch(path, prompts, threads)
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


def _one_batch(path: Path, prompts: list[list[int]], threads: int | None) -> list[np.ndarray]:
    """Every prompt a sequence of its own in one batch, decoded once: each position attends to its own sequence
    only (llama.cpp masks the others), so each prompt's logits are those of running it alone, to the order of
    float sums; the weights are read once for all. Why: a short prompt's decode is bound by reading every weight,
    so the seven proof texts (132 tokens on SmolLM2's vocabulary) one by one cost about as much as seven times the
    longest."""
    from llama_cpp import _internals

    llama_cpp = _llama_cpp()
    total = sum(len(p) for p in prompts)
    n_ctx = max(64, total + 8)
    n_threads = threads or os.cpu_count()
    llm = _open(path, n_ctx=64, n_batch=64, n_threads=n_threads)  # the model; its own small context goes unused
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
    params.n_threads = params.n_threads_batch = n_threads
    params.n_seq_max, params.kv_unified = len(prompts), True
    ctx = batch = None
    try:
        ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
        batch = _internals.LlamaBatch(n_tokens=total, embd=0, n_seq_max=len(prompts), verbose=False)
        for seq, ids in enumerate(prompts):
            batch.add_sequence(ids, seq, True)
        ctx.decode(batch)
        rows = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx.ctx), shape=(total, llm.n_vocab()))
        ends = np.cumsum([len(p) for p in prompts])
        return [np.array(part, dtype=np.float32) for part in np.split(rows, ends[:-1])]
    finally:
        for held in (batch, ctx, llm):
            if held is not None:
                held.close()


def quantize(src: Path, dst: Path, type_name: str) -> None:
    """llama.cpp's own quantizer (llama_model_quantize), `src` (F32/F16 GGUF) -> `dst` in `type_name`."""
    llama_cpp = _llama_cpp(f"GGUF type {type_name}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_name}")
    params.nthread = os.cpu_count() or 1
    code = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if code != 0:
        raise BadInputError(f"{src.name}: llama.cpp's quantizer failed for {type_name} (code {code})", file=src)
