"""Open any base: a transformers folder, a diffusers pipeline folder, a single-file diffusion checkpoint, or a
training checkpoint. The one place that picks the reader: `converter.engine.checkpoint` reads safetensors layouts
and knows nothing of training layouts; those are read by the readers registered with `converter.engine.readers`
(`converter.training` registers its own), which are asked first.
"""

from __future__ import annotations

import json
from pathlib import Path

from converter.engine.checkpoint import Checkpoint, DiffusersCheckpoint, SingleFileCheckpoint
from converter.engine.keymap import all_keymaps, diffusion_family
from converter.engine.readers import base_readers
from converter.errors import CheckpointError, CheckpointNotFound, UsageError
from converter.io.safetensors_file import SafetensorsFile


def open_base(
    path: Path, *, lora_alpha: float | None = None, allow_pickle: bool = False, config: str | Path | None = None
) -> Checkpoint:
    """A transformers-style model folder, a diffusers pipeline folder, a single-file diffusion checkpoint, or a
    training checkpoint from any folder of its run (verl, Megatron-LM, torchtitan, DCP; `lora_alpha` for the LoRA
    inside one, `config` the Hugging Face config it lacks: see converter.training). A folder that is none of them
    is refused in one line naming the layouts looked for."""
    path = Path(path)
    bare = path.is_dir() and not (path / "config.json").is_file() and not (path / "model_index.json").is_file()
    for reader in base_readers():
        if not (bare or reader.owns(path)):
            continue
        try:
            return reader.open(path, lora_alpha=lora_alpha, allow_pickle=allow_pickle, config=config)
        except CheckpointNotFound as e:
            if (path / "adapter_config.json").is_file():
                raise UsageError(
                    f"{path}: an adapter (adapter_config.json), not a model: give it as --adapter, with the model it "
                    "was trained on as --base"
                ) from None
            if not any(path.glob("*.safetensors")):
                raise CheckpointNotFound(f"{e}; nor a model folder: no config.json", file=path) from None
    if config is not None:
        raise UsageError(
            f"--config {config}: it is for training checkpoints without a Hugging Face config; {path} is not one"
        )
    if path.is_dir() and (path / "model_index.json").is_file():
        try:
            index = json.loads((path / "model_index.json").read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(
                f"{path / 'model_index.json'}: invalid JSON ({e.msg})", file=path / "model_index.json"
            ) from None
        pipeline = index.get("_class_name")
        denoiser = next((v[1] for k, v in index.items() if k in ("transformer", "unet") and isinstance(v, list)), None)
        family = diffusion_family(pipeline, []) or diffusion_family(None, [], denoiser)
        if family is None:
            raise CheckpointError(
                f"{path}: diffusers pipeline {pipeline} has no keymap yet (supported: "
                f"{', '.join(sorted(p for k in _families() for p in k.pipelines))})",
                file=path,
            )
        return DiffusersCheckpoint(path, family.name)
    if path.is_file() and path.suffix == ".safetensors":
        f = SafetensorsFile(path)
        family = diffusion_family(None, list(f.tensors))
        if family is None:
            sample = ", ".join(list(f.tensors)[:4])
            raise CheckpointError(
                f"{path}: a single-file checkpoint of no known family (keys like {sample}); known: "
                f"{', '.join(k.name for k in _families())}",
                file=path,
            )
        return SingleFileCheckpoint(path, family)
    return Checkpoint(path)


def _families():
    return [k for k in all_keymaps() if k.is_diffusion]
