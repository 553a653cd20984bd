"""`converter inspect`: what a model folder or an adapter is, without loading weights."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from converter.checkpoint import Checkpoint
from converter.errors import ConverterError
from converter.formats import load_adapter
from converter.keymap import keymap_for
from converter.sources import resolve_local
from converter.units import human_bytes


def inspect_path(spec: str, allow_pickle: bool = False) -> dict:
    path = resolve_local(spec)
    if path.is_dir() and (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        return inspect_model(path)
    try:
        return inspect_adapter(path, allow_pickle)
    except ConverterError:
        if path.is_dir() and (path / "config.json").is_file():
            return inspect_model(path)
        raise


def inspect_model(path: Path) -> dict:
    ckpt = Checkpoint(path)
    dtypes = Counter()
    params = 0
    for key in ckpt.names():
        info = ckpt.info(key)
        dtypes[info.dtype] += info.numel
        params += info.numel
    cfg = ckpt.config
    return {
        "kind": "model",
        "path": str(path),
        "architecture": (cfg.get("architectures") or ["?"])[0],
        "model_type": cfg.get("model_type"),
        "keymap": keymap_for(cfg).name,
        "dtype": cfg.get("dtype") or cfg.get("torch_dtype"),
        "tensor_dtypes": {k: v for k, v in dtypes.most_common()},
        "parameters": params,
        "tensors": len(ckpt.where),
        "shards": [f.path.name for f in ckpt.files],
        "size": ckpt.total_bytes,
        "tie_word_embeddings": cfg.get("tie_word_embeddings"),
        "vocab_size": cfg.get("vocab_size"),
        "hidden_size": cfg.get("hidden_size"),
        "layers": cfg.get("num_hidden_layers"),
    }


def inspect_adapter(path: Path, allow_pickle: bool) -> dict:
    adapter = load_adapter(path, allow_pickle=allow_pickle)
    names = adapter.tensors.names()
    params = sum(_numel(adapter.tensors.shape(n)) for n in names)
    kinds = Counter(type(ap.patch).__name__ for ap in adapter.patches)
    modules = sorted({ap.module for ap in adapter.patches})
    return {
        "kind": "adapter",
        "path": str(path),
        "format": adapter.format,
        **adapter.summary,
        "base_model": adapter.base_model,
        "patches": dict(kinds),
        "modules": len(modules),
        "module_names": sorted({m.rsplit(".", 1)[-1] for m in modules}),
        "tensors": len(names),
        "parameters": params,
        "size": sum(p.stat().st_size for p in adapter.files),
        "tensor_dtypes": dict(Counter(adapter.tensors.dtype(n) for n in names)),
        "has_tokenizer": adapter.tokenizer_dir is not None,
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def render(info: dict, as_json: bool = False) -> str:
    if as_json:
        return json.dumps(info, indent=2, default=str)
    lines = []
    for key, value in info.items():
        if value in (None, {}, [], False) and key not in ("use_dora", "use_rslora"):
            continue
        if key == "size":
            value = human_bytes(value)
        elif key == "parameters":
            value = f"{value:,}"
        elif isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items())
        elif isinstance(value, list):
            value = ", ".join(map(str, value)) if len(value) <= 12 else f"{len(value)} entries"
        lines.append(f"{key:>24}: {value}")
    return "\n".join(lines)
