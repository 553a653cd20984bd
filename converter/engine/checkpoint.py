"""Lazy, validated views of model folders: names, shapes, dtypes; one tensor at a time.

A model folder (config + shards or index), a diffusers pipeline folder and a single-file checkpoint, each over the
safetensors files of converter.io.safetensors_file.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from converter.engine.keymap import DiffusionResolver, Resolver
from converter.errors import CheckpointError
from converter.io.lazy import torch
from converter.io.safetensors_file import SafetensorsFile, TensorInfo

WEIGHT_INDEXES = ("model.safetensors.index.json",)


@dataclass(frozen=True)
class Part:
    """Where a group of output tensors goes: a subfolder, its shard file stem, and how its names are prefixed
    in the checkpoint's key namespace (diffusers components are `unet/...`, `text_encoder/...`)."""

    subfolder: str = ""
    prefix: str = ""
    stem: str = "model"
    single_file: str | None = None  # write exactly this one file (a single-file checkpoint keeps its name)
    metadata: tuple[tuple[str, str], ...] = ()


class Checkpoint:
    """A model folder: config.json plus safetensors weights (one file or shards with an index)."""

    parts: tuple[Part, ...] = (Part(),)
    diffusion: str | None = None  # "diffusers" (pipeline folder) or "single_file"

    def make_resolver(self, keymap):
        shapes = {k: self.info(k).shape for k in self.names()} if keymap.experts else None
        return Resolver(keymap, self.config, set(self.names()), shapes)

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CheckpointError(
                f"{self.folder}: base is not a folder (expected a model folder with config.json)", file=self.folder
            )
        config_path = self.folder / "config.json"
        if not config_path.is_file():
            raise CheckpointError(
                f"{self.folder}: not a model folder: no config.json (point --base at the folder)", file=self.folder
            )
        try:
            self.config: dict = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(
                f"{config_path}: invalid JSON ({e.msg} at line {e.lineno})", file=config_path
            ) from None
        self.files = [SafetensorsFile(p) for p in self._weight_files()]
        self.where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.tensors:
                if name in self.where:
                    raise CheckpointError(
                        f"{f.path}: tensor {name!r} also appears in {self.where[name].path.name}",
                        file=f.path,
                        tensor=name,
                    )
                self.where[name] = f

    def _weight_files(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError):
                raise CheckpointError(f"{index}: not a valid safetensors index (no weight_map)", file=index) from None
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (self.folder / n).is_file()]
            if missing:
                raise CheckpointError(
                    f"{index}: lists shard {missing[0]} which is not in the folder (incomplete download?)", file=index
                )
            return [self.folder / n for n in names]
        files = sorted(self.folder.glob("*.safetensors"))
        if files:
            return files
        if any(self.folder.glob("*.bin")) or any(self.folder.glob("*.pt")):
            raise CheckpointError(
                f"{self.folder}: the base has only pickle weights (.bin/.pt); save it as safetensors first "
                "(transformers: model.save_pretrained(folder))",
                file=self.folder,
            )
        raise CheckpointError(f"{self.folder}: not a model folder: no *.safetensors weights found", file=self.folder)

    def names(self) -> list[str]:
        """Tensor names in file order (file by file, by byte offset): the order a sequential read takes."""
        out = []
        for f in self.files:
            out.extend(sorted(f.tensors, key=lambda n, f=f: f.tensors[n].start))
        return out

    def info(self, name: str) -> TensorInfo:
        return self.where[name].tensors[name]

    def read(self, name: str) -> torch.Tensor:
        return self.where[name].read(name)

    def read_bytes(self, name: str) -> np.ndarray:
        return self.where[name].read_bytes(name)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def _variant_free(files: list[Path]) -> list[Path]:
    """Drop `name.fp16.safetensors`-style variants when the plain files are there (diffusers repos ship both)."""
    plain = [f for f in files if "." not in f.name[: -len(".safetensors")]]
    return plain or files


class DiffusersCheckpoint(Checkpoint):
    """A diffusers pipeline folder (model_index.json): every component subfolder with safetensors weights is a
    part; keys are `<component>/<key>` so one plan covers the pipeline and each part is written back in place."""

    diffusion = "diffusers"

    def __init__(self, folder: Path, keymap_name: str):
        self.folder = Path(folder)
        index = json.loads((self.folder / "model_index.json").read_text())
        self.pipeline = index.get("_class_name")
        self.config = {"_keymap": keymap_name, "_class_name": self.pipeline}
        self.component_configs: dict[str, dict] = {}
        self.files = []
        self.where = {}
        self._names: dict[str, str] = {}  # namespaced key -> key in its file
        parts = []
        for sub in sorted(p for p in self.folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
            idx = [
                i for i in sub.glob("*.safetensors.index.json") if "." not in i.name[: -len(".safetensors.index.json")]
            ]
            if idx:
                weight_map = json.loads(idx[0].read_text())["weight_map"]
                files = [sub / n for n in sorted(set(weight_map.values()))]
                stem = idx[0].name[: -len(".safetensors.index.json")]
            else:
                files = _variant_free(sorted(sub.glob("*.safetensors")))
                if not files:
                    continue
                stem = files[0].name.split(".")[0].split("-0")[0]
            if (sub / "config.json").is_file():
                self.component_configs[sub.name] = json.loads((sub / "config.json").read_text())
            single = files[0].name if len(files) == 1 else None
            parts.append(Part(sub.name, f"{sub.name}/", stem, None if idx else single))
            for path in files:
                f = SafetensorsFile(path)
                self.files.append(f)
                for name in f.tensors:
                    self.where[f"{sub.name}/{name}"] = f
                    self._names[f"{sub.name}/{name}"] = name
        if not self.files:
            raise CheckpointError(
                f"{self.folder}: diffusers folder without safetensors weights in any component", file=self.folder
            )
        self.parts = tuple(parts)

    def names(self) -> list[str]:
        out = []
        for f in self.files:
            sub = f.path.parent.name
            out.extend(f"{sub}/{n}" for n in sorted(f.tensors, key=lambda n, f=f: f.tensors[n].start))
        return out

    def info(self, name: str) -> TensorInfo:
        return dataclasses.replace(self.where[name].tensors[self._names[name]], name=name)

    def read(self, name: str) -> torch.Tensor:
        return self.where[name].read(self._names[name])

    def read_bytes(self, name: str) -> np.ndarray:
        return self.where[name].read_bytes(self._names[name])

    def make_resolver(self, keymap):
        keys = {k: self.info(k).shape for k in self.names()}
        parts = {p.subfolder: (p.prefix, {**keymap.defaults, **self.component_configs.get(p.subfolder, {})})
                 for p in self.parts}  # fmt: skip
        return DiffusionResolver(keymap, parts, keys)


class SingleFileCheckpoint(Checkpoint):
    """One .safetensors file holding a whole pipeline or denoiser (LDM SD1.x/SDXL, BFL Flux, ComfyUI): written
    back as one file of the same name, components told apart by the key prefixes in the family's keymap."""

    diffusion = "single_file"

    def __init__(self, path: Path, keymap):
        self.path = Path(path)
        self.folder = self.path.parent
        f = SafetensorsFile(self.path)
        self.files = [f]
        self.where = dict.fromkeys(f.tensors, f)
        self.config = {"_keymap": keymap.name}
        self.keymap = keymap
        meta = tuple(sorted((k, v) for k, v in f.metadata.items() if k != "format"))
        self.parts = (Part("", "", self.path.stem, self.path.name, meta),)

    def make_resolver(self, keymap):
        keys = {k: self.info(k).shape for k in self.names()}
        parts = {}
        for component, prefixes in keymap.components.items():
            for prefix in prefixes:  # the first prefix the file uses ("" takes every key)
                if any(k.startswith(prefix) for k in keys):
                    parts[component] = (prefix, dict(keymap.defaults))
                    break
        return DiffusionResolver(keymap, parts, keys)
