"""What every adapter format parses into: patches on the adapter's own (native) module names."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from converter.errors import AdapterFormatError
from converter.formats.patches import Patch
from converter.io import dtypes
from converter.io.lazy import torch
from converter.io.safetensors_file import SafetensorsFile


class SafetensorsSource:
    """Adapter tensors in a .safetensors file, read one at a time."""

    def __init__(self, path: Path):
        self.file = SafetensorsFile(path)
        self.path = self.file.path
        self.metadata = self.file.metadata

    def names(self) -> list[str]:
        return list(self.file.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file.tensors[name].shape

    def dtype(self, name: str) -> str:
        return self.file.tensors[name].dtype

    def read(self, name: str) -> torch.Tensor:
        return self.file.read(name)


class PickleSource:
    """Adapter tensors from a pickle checkpoint (.bin), loaded with weights_only=True (no code execution)."""

    def __init__(self, path: Path):
        self.path = path
        self.metadata: dict[str, str] = {}
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
            raise AdapterFormatError(
                f"{path}: cannot load as a weights-only torch checkpoint ({type(e).__name__})", file=path
            ) from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise AdapterFormatError(f"{path}: expected a dict of tensors", file=path)
        self.tensors: dict[str, torch.Tensor] = state

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> str:
        return dtypes.TORCH_TO_ST[self.tensors[name].dtype]

    def read(self, name: str) -> torch.Tensor:
        return self.tensors[name]


TensorFile = SafetensorsSource | PickleSource


def open_tensor_file(path: Path, allow_pickle: bool) -> TensorFile:
    if path.suffix == ".safetensors":
        return SafetensorsSource(path)
    if not allow_pickle:
        raise AdapterFormatError(
            f"{path}: pickle checkpoints can run code when loaded; pass --allow-pickle to load it "
            "(weights only), or convert it to .safetensors",
            file=path,
        )
    return PickleSource(path)


@dataclass
class AdapterPatch:
    """One patch on a native module parameter, e.g. module 'model.layers.0.self_attn.q_proj', param 'weight'."""

    module: str
    param: str
    patch: Patch
    # The adapter's own word on layout (PEFT fan_in_fan_out); used only where the keymap knows nothing.
    stored_transposed: bool | None = None
    # Applies to a tied output head too (PEFT applies trainable tokens to both sides of a tie).
    follows_tie: bool = False
    # Community formats: which part of a diffusion base the module belongs to ("denoiser", "text_encoder",
    # "text_encoder_2", ...; None: the whole model), and whether its name is kohya-flattened ('.' -> '_').
    component: str | None = None
    flat: bool = False
    # The module's name exactly as the file spells it (prefix included), so a writer can reproduce the file.
    native: str | None = None
    # PEFT target_parameters: the file does not say which of a module's parameters a wrapper's LoRA is for (one
    # `base_layer.` per wrapped parameter). (param, patch) candidates; the plan keeps the one the base's shapes fit.
    either: tuple[tuple[str, Patch], ...] = ()

    @property
    def name(self) -> str:
        return f"{self.module}.{self.param}"


@dataclass
class Adapter:
    path: Path
    format: str
    tensors: TensorFile
    patches: list[AdapterPatch]
    config: dict = field(default_factory=dict)
    base_model: str | None = None
    summary: dict = field(default_factory=dict)
    tokenizer_dir: Path | None = None
    files: list[Path] = field(default_factory=list)
    # An adapter's own full model config (some trainers save one): used for the config sanity check.
    model_config: dict | None = None
    # Things about the file itself worth saying before merging (e.g. kohya's split_qkv layout).
    warnings: list[str] = field(default_factory=list)
