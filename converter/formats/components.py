"""A multi-component PEFT folder (`unet/`, `text_encoder/`, ... each with its adapter_config.json), as `converter
convert --to peft` writes for a diffusion adapter: read back as one adapter, each patch tagged with its component."""

from __future__ import annotations

from pathlib import Path

from converter.errors import AdapterFormatError
from converter.formats.adapter import Adapter
from converter.io.lazy import torch

DENOISERS = ("unet", "transformer")
COMPONENTS = (*DENOISERS, "text_encoder", "text_encoder_2", "text_encoder_3")


def component_folders(path: Path) -> list[Path]:
    """The component subfolders of `path` that hold a PEFT adapter (empty: not a multi-component folder)."""
    if not path.is_dir() or (path / "adapter_config.json").is_file():
        return []
    return [path / c for c in COMPONENTS if (path / c / "adapter_config.json").is_file()]


class ChainedTensors:
    """The tensors of every component's file under their own names (which must not collide)."""

    def __init__(self, path: Path, parts: list):
        self.path, self.parts, self.metadata = path, parts, {}
        self._where = {}
        for part in parts:
            for name in part.names():
                if name in self._where:
                    raise AdapterFormatError(f"{path}: tensor {name} is in two components; keep one", file=path)
                self._where[name] = part

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)

    def dtype(self, name: str) -> str:
        return self._where[name].dtype(name)

    def read(self, name: str) -> torch.Tensor:
        return self._where[name].read(name)


def load_components(path: Path, folders: list[Path], parse) -> Adapter:
    """Parse each component folder with `parse` (the PEFT reader) and join them into one adapter."""
    parts = [parse(f) for f in folders]
    patches = []
    for folder, part in zip(folders, parts, strict=True):
        component = "denoiser" if folder.name in DENOISERS else folder.name
        for ap in part.patches:
            ap.component = component
            patches.append(ap)
    first = parts[0]
    return Adapter(
        path=path,
        # not "peft": its per-component configs are kept under `config`, and each module's alpha is its own
        # scale · rank (what the PEFT reader computed from that component's config)
        format=f"{first.format} (components)",
        tensors=ChainedTensors(path, [p.tensors for p in parts]),
        patches=patches,
        config={f.name: p.config for f, p in zip(folders, parts, strict=True)},
        base_model=next((p.base_model for p in parts if p.base_model), None),
        summary={**first.summary, "components": [f.name for f in folders]},
        files=[file for p in parts for file in p.files],
        warnings=[w for p in parts for w in p.warnings],
    )
