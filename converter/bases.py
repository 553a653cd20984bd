"""Open any base: a transformers folder, a diffusers pipeline folder, a single-file diffusion checkpoint, or a
training checkpoint. The one place that picks the reader, in front of the engine: `converter.checkpoint` reads
safetensors layouts and knows nothing of training layouts (`converter.training` builds on it), so the choice
between them is made here, above both.
"""

from __future__ import annotations

import json
from pathlib import Path

from converter.checkpoint import Checkpoint, DiffusersCheckpoint, SafetensorsFile, SingleFileCheckpoint
from converter.errors import ConverterError


def open_base(path: Path, *, lora_alpha: float | None = None, allow_pickle: bool = False) -> Checkpoint:
    """A transformers-style model folder, a diffusers pipeline folder, a single-file diffusion checkpoint, or a
    training checkpoint (verl FSDP rank files, DCP; `lora_alpha` for the LoRA inside one, see converter.training)."""
    from converter.keymap import diffusion_family

    path = Path(path)
    if not (path / "config.json").is_file():
        from converter.training import is_training_checkpoint, open_training

        if is_training_checkpoint(path):
            return open_training(path, lora_alpha=lora_alpha, allow_pickle=allow_pickle)
    if path.is_dir() and (path / "model_index.json").is_file():
        try:
            pipeline = json.loads((path / "model_index.json").read_text()).get("_class_name")
        except json.JSONDecodeError as e:
            raise ConverterError(f"{path / 'model_index.json'}: invalid JSON ({e.msg})") from None
        family = diffusion_family(pipeline, [])
        if family is None:
            raise ConverterError(
                f"{path}: diffusers pipeline {pipeline} has no keymap yet (supported: "
                f"{', '.join(sorted(p for k in _families() for p in k.pipelines))})"
            )
        return DiffusersCheckpoint(path, family.name)
    if path.is_file() and path.suffix == ".safetensors":
        f = SafetensorsFile(path)
        family = diffusion_family(None, list(f.tensors))
        if family is None:
            sample = ", ".join(list(f.tensors)[:4])
            raise ConverterError(
                f"{path}: a single-file checkpoint of no known family (keys like {sample}); known: "
                f"{', '.join(k.name for k in _families())}"
            )
        return SingleFileCheckpoint(path, family)
    return Checkpoint(path)


def _families():
    from converter.keymap import all_keymaps

    return [k for k in all_keymaps() if k.is_diffusion]
