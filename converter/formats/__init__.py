"""Adapter formats: each module detects its files and parses them into `Adapter` patches."""

from __future__ import annotations

from pathlib import Path

from converter.errors import AdapterFormatError, ConverterError
from converter.formats import community, peft
from converter.formats.adapter import Adapter, AdapterPatch
from converter.formats.components import component_folders, load_components
from converter.io.safetensors_file import SafetensorsFile

FORMATS = [peft, community]

__all__ = ["Adapter", "AdapterPatch", "load_adapter"]


def load_adapter(
    path: Path, *, allow_pickle: bool = False, lora_alpha: float | None = None, require_scale: bool = True
) -> Adapter:
    """Detect the format of the adapter at `path` and parse it.

    `lora_alpha` is the user's word on the scale where the files say nothing (PEFT weights without their
    adapter_config.json): each module's scale is then lora_alpha / its rank. Without it such weights are refused
    unless `require_scale` is False (inspect: describe them with a warning, merged at scale 1).
    """
    path = Path(path)
    if not path.exists():
        raise AdapterFormatError(
            f"{path}: adapter not found (give a folder with adapter_config.json or a file)", file=path
        )

    if folders := component_folders(path):  # unet/, text_encoder/: what `convert --to peft` writes for diffusion
        return load_components(
            path, folders, lambda f: load_adapter(f, allow_pickle=allow_pickle, require_scale=require_scale)
        )
    for fmt in FORMATS:
        if fmt.detect(path):
            return fmt.parse(path, allow_pickle=allow_pickle, lora_alpha=lora_alpha, require_scale=require_scale)
    raise AdapterFormatError(
        f"{path}: not a recognised adapter{_sample(path)}; tried PEFT (a folder with adapter_config.json), "
        "kohya/LyCORIS/OneTrainer/musubi (lora_unet_*, lora_te*_*, lycoris_*), diffusers/ComfyUI (unet.*, "
        "transformer.*, diffusion_model.* with lora_A/lora_B or lora_down/lora_up)",
        file=path,
    )


def _sample(path: Path) -> str:
    """A few of the file's tensor names, so an unknown format can be recognised by whoever reads the error."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))[:1]
    if not files or files[0].suffix != ".safetensors":
        return ""
    try:
        names = list(SafetensorsFile(files[0]).tensors)[:4]
    except ConverterError:
        return ""
    return f" (keys like {', '.join(names)})" if names else " (no tensors)"
