"""`converter inspect`: what a model folder or an adapter is, without loading weights."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from converter.engine.base_reader import open_base
from converter.engine.checkpoint import Checkpoint
from converter.engine.family import convert_hint, identify
from converter.engine.keymap import keymap_for
from converter.errors import ConverterError, HubError
from converter.formats import load_adapter
from converter.hub import client as hub
from converter.hub.remote_headers import hub_base_headers
from converter.hub.sources import Source, fetch, parse_source
from converter.io.scratch import temp_folder
from converter.io.units import human_bytes
from converter.training import is_training_checkpoint, open_training


def inspect_path(spec: str, allow_pickle: bool = False, token: str | None = None, config: str | None = None) -> dict:
    source = parse_source(spec)
    if source.local is None:
        return inspect_hub(source, allow_pickle, token)
    path = source.local
    if path.is_dir() and (path / "model_index.json").is_file():
        return inspect_diffusion(path)

    if is_training_checkpoint(path):
        return inspect_training(path, allow_pickle, config)
    if path.is_dir() and (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        return inspect_model(path)
    try:
        return inspect_adapter(path, allow_pickle)
    except ConverterError:
        if path.is_dir() and (path / "config.json").is_file():
            return inspect_model(path)
        if path.is_file() and path.suffix == ".safetensors":
            return inspect_diffusion(path)  # a single-file checkpoint (or a clear error naming its keys)
        raise


def inspect_diffusion(path: Path) -> dict:
    """A diffusers pipeline folder or a single-file diffusion checkpoint: family, components, sizes."""
    ckpt = open_base(path)
    dtypes: Counter = Counter()
    components: Counter = Counter()
    resolver = ckpt.make_resolver(keymap_for(ckpt.config))
    for key in ckpt.names():
        info = ckpt.info(key)
        dtypes[info.dtype] += info.numel
    for component, table in resolver.dotted.items():
        components[component] = len({p.key for places in table.values() for p in places})
    return {
        "kind": "model",
        "path": str(path),
        "layout": ckpt.diffusion,
        "keymap": ckpt.config["_keymap"],
        "pipeline": ckpt.config.get("_class_name"),
        "components": dict(components),
        "tensor_dtypes": dict(dtypes.most_common()),
        "parameters": sum(dtypes.values()),
        "tensors": len(ckpt.names()),
        "size": ckpt.total_bytes,
    }


def inspect_hub(source: Source, allow_pickle: bool, token: str | None) -> dict:
    """A Hub repo without downloading weights: adapters are small (fetched), models are read from their
    headers (sparse stand-ins, converter.hub.remote_headers) and described like a local folder."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    where = f"{source.repo_id}@{source.revision or 'main'}"
    info = hub.call(
        where,
        lambda: api.model_info(source.repo_id, revision=source.revision),
        repo_id=source.repo_id,
        revision=source.revision or "main",
    )
    names = {s.rfilename for s in info.siblings or []}
    if source.path or "adapter_config.json" in names:
        fetched = fetch(source.spec, "adapter", token)
        return {**inspect_adapter(fetched.local, allow_pickle, shown=source.spec), "path": fetched.pinned}
    if "config.json" not in names and "model_index.json" not in names:
        raise HubError(
            f"{where}: neither a model (config.json) nor an adapter (adapter_config.json)",
            repo_id=source.repo_id,
            revision=source.revision or "main",
        )
    with temp_folder("headers", log=lambda line: print(line, file=sys.stderr)) as scratch:
        base = hub_base_headers(source, token, Path(scratch))
        diffusion = (base.path / "model_index.json").is_file()
        described = inspect_diffusion(base.path) if diffusion else inspect_model(base.path)
    return {**described, "path": base.pinned}


def inspect_model(path: Path) -> dict:
    ckpt = Checkpoint(path)
    dtypes = Counter()
    for key in ckpt.names():
        info = ckpt.info(key)
        dtypes[info.dtype] += info.numel
    return _model_summary(
        str(path), ckpt.config, dtypes, len(ckpt.where), [f.path.name for f in ckpt.files], ckpt.total_bytes
    )


def inspect_training(path: Path, allow_pickle: bool, config: str | None = None) -> dict:
    """A training checkpoint (verl, Megatron-LM, torchtitan, DCP): the model it holds, from the shards' metadata."""
    ckpt = open_training(path, allow_pickle=allow_pickle, config=config)
    dtypes = Counter()
    for key in ckpt.names():
        info = ckpt.info(key)
        dtypes[info.dtype] += info.numel
    shards = [f.path.name for f in ckpt.files]
    summary = _model_summary(str(path), ckpt.config, dtypes, len(ckpt.names()), shards, ckpt.total_bytes)
    if not hasattr(ckpt, "source"):  # its weights are a Hugging Face folder inside (verl with Megatron-Bridge)
        return {**summary, "layout": "Hugging Face folder", "notes": ckpt.notes}
    return {**summary, "layout": ckpt.source.kind, "notes": ckpt.notes}


def _model_summary(where: str, cfg: dict, dtypes: Counter, tensors: int, shards: list[str], size: int) -> dict:
    return {
        "kind": "model",
        "path": where,
        "architecture": (cfg.get("architectures") or ["?"])[0],
        "model_type": cfg.get("model_type"),
        "keymap": keymap_for(cfg).name,
        "dtype": cfg.get("dtype") or cfg.get("torch_dtype"),
        "tensor_dtypes": dict(dtypes.most_common()),
        "parameters": sum(dtypes.values()),
        "tensors": tensors,
        "shards": shards,
        "size": size,
        "tie_word_embeddings": cfg.get("tie_word_embeddings"),
        "vocab_size": cfg.get("vocab_size"),
        "hidden_size": cfg.get("hidden_size"),
        "layers": cfg.get("num_hidden_layers"),
    }


def inspect_adapter(path: Path, allow_pickle: bool, shown: str | None = None) -> dict:
    """`shown`: how the user named the adapter (a Hub id), for the commands printed; default its path."""
    adapter = load_adapter(path, allow_pickle=allow_pickle, require_scale=False)
    names = adapter.tensors.names()
    params = sum(_numel(adapter.tensors.shape(n)) for n in names)
    kinds = Counter(type(ap.patch).__name__ for ap in adapter.patches)
    modules = sorted({ap.module for ap in adapter.patches})
    return {
        "kind": "adapter",
        "path": str(path),
        "format": adapter.format,
        **_family(adapter, shown or str(path)),
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


def _family(adapter, path: str) -> dict:
    """A diffusion LoRA's family and spelling, the tools that load it as it is, and the command for the others."""
    identity = identify(adapter)
    if identity is None or (identity.family is None and not identity.candidates):
        return {}
    if identity.family is None:
        # the names fit several families (FLUX.1's and HunyuanVideo's diffusers blocks are alike)
        return {"family": None, "family_candidates": identity.candidates, "spelling": identity.spelling}
    return {
        "family": identity.family.name,
        "family_title": identity.family.title,
        "spelling": identity.spelling,
        "loads_in": identity.loads_in(),
        "convert_for": convert_hint(identity, path),
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
