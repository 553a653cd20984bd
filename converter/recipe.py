"""`Recipe`: everything a merge needs, the one object every front end builds. YAML in and out, no I/O else."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from converter.errors import ConverterError

# Names a per-component weight may use (kohya "strength" for UNet and text encoder separately).
COMPONENT_WEIGHTS = {"unet", "transformer", "denoiser", "text_encoder", "text_encoder_2", "text_encoder_3", "default"}
DENOISERS = ("unet", "transformer", "denoiser")


@dataclass
class AdapterSpec:
    source: str
    # A number, or per component of a diffusion base: {unet: 1.0, text_encoder: 0.5, default: 1.0}.
    weight: float | dict[str, float] = 1.0
    # Regexes over base tensor names (re.search): the adapter only touches tensors that match include (when
    # given) and do not match exclude.
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)

    def weight_for(self, component: str | None) -> float:
        """The weight for a patch on `component` (a base subfolder or the adapter's component name)."""
        if not isinstance(self.weight, dict):
            return self.weight
        if component in self.weight:
            return float(self.weight[component])
        if component in DENOISERS or component is None:
            for name in DENOISERS:
                if name in self.weight:
                    return float(self.weight[name])
        return float(self.weight.get("default", 1.0))

    def admits(self, key: str) -> bool:
        if self.include and not any(re.search(p, key) for p in self.include):
            return False
        return not any(re.search(p, key) for p in self.exclude)


@dataclass
class Recipe:
    base: str
    adapters: list[AdapterSpec]
    dtype: str | None = None  # None keeps each tensor's dtype
    out: str | None = None
    max_shard_size: str = "5GB"
    allow_unmatched: bool = False
    allow_pickle: bool = False
    # QLoRA adapters: "original" merges into the full-precision base; "dequantized" first rounds each targeted
    # weight through 4-bit quantization with the training settings, which is exactly what the adapter saw.
    qlora: bool = False  # the adapters were trained on a 4-bit base (also detected from cards and configs)
    qlora_base: str = "original"
    qlora_quant: str = "nf4"
    qlora_blocksize: int = 64
    qlora_double_quant: bool = True

    def __post_init__(self) -> None:
        if self.qlora_base not in ("original", "dequantized"):
            raise ConverterError(f"qlora_base {self.qlora_base!r}: use original or dequantized")
        if self.qlora_quant not in ("nf4", "fp4"):
            raise ConverterError(f"qlora_quant {self.qlora_quant!r}: use nf4 or fp4")
        if not self.adapters and not _is_training_checkpoint(self.base):  # a training run's state is whole
            raise ConverterError("recipe has no adapters: give at least one --adapter")
        for spec in self.adapters:
            if isinstance(spec.weight, dict) and not set(spec.weight) <= COMPONENT_WEIGHTS:
                unknown = sorted(set(spec.weight) - COMPONENT_WEIGHTS)
                raise ConverterError(
                    f"adapter {spec.source}: weight for unknown component {unknown[0]!r} "
                    f"(use {', '.join(sorted(COMPONENT_WEIGHTS))})"
                )
            for pattern in (*spec.include, *spec.exclude):
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise ConverterError(
                        f"adapter {spec.source}: bad include/exclude regex {pattern!r} ({e})"
                    ) from None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["adapters"] = [{k: v for k, v in asdict(a).items() if v not in ([], None)} for a in self.adapters]
        return {k: v for k, v in data.items() if v is not None}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict) -> Recipe:
        if not isinstance(data, dict) or "base" not in data:
            raise ConverterError("recipe needs a 'base' and a list of 'adapters'")
        adapters = []
        for entry in data.get("adapters") or []:
            if isinstance(entry, str):
                entry = {"source": entry}
            try:
                adapters.append(AdapterSpec(**entry))
            except TypeError as e:
                raise ConverterError(f"recipe adapter entry {entry!r}: {e}") from None
        fields = {k: v for k, v in data.items() if k != "adapters"}
        try:
            return cls(adapters=adapters, **fields)
        except TypeError as e:
            raise ConverterError(f"recipe: {e}") from None

    @classmethod
    def load(cls, path: Path) -> Recipe:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise ConverterError(f"{path}: recipe file not found") from None
        except yaml.YAMLError as e:
            raise ConverterError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
        recipe = cls.from_dict(data)
        # Local paths in a recipe are relative to the recipe file, so a recipe travels with its folder.
        here = Path(path).resolve().parent
        recipe.base = _relative_to(recipe.base, here)
        for spec in recipe.adapters:
            spec.source = _relative_to(spec.source, here)
        if recipe.out:
            recipe.out = str(here / recipe.out) if not Path(recipe.out).is_absolute() else recipe.out
        return recipe


def _relative_to(spec: str, here: Path) -> str:
    candidate = here / spec
    return str(candidate) if not Path(spec).is_absolute() and candidate.exists() else spec


def _is_training_checkpoint(base: str | None) -> bool:
    from converter.training import is_training_checkpoint

    return bool(base) and is_training_checkpoint(Path(base))
