"""`Recipe`: everything a merge needs, the one object every front end builds. YAML in and out, no I/O else."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

from converter.engine.readers import base_readers
from converter.errors import RecipeError
from converter.io.records import RECIPE_FILE

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
    # The scale where the adapter's files do not say it (PEFT weights without adapter_config.json): each module
    # is scaled by lora_alpha / its rank. None: from the files, or refused when they do not say.
    lora_alpha: float | None = None

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
    max_shard_size: str | None = None  # None: 5GB (a pipelined push picks its own size)
    allow_unmatched: bool = False
    allow_pickle: bool = False
    # QLoRA adapters: "original" merges into the full-precision base; "dequantized" first rounds each targeted
    # weight through 4-bit quantization with the training settings, which is exactly what the adapter saw.
    qlora: bool = False  # the adapters were trained on a 4-bit base (also detected from cards and configs)
    qlora_base: str = "original"
    qlora_quant: str = "nf4"
    qlora_blocksize: int = 64
    qlora_double_quant: bool = True
    # Not a plain sum: "ties", "dare", "dare_ties" or "magnitude_prune" on each tensor's deltas (None: the sum);
    # density = fraction of each delta kept, seed = DARE's masks (converter.engine.taskmerge).
    method: str | None = None
    density: float | None = None
    seed: int | None = None
    # A training checkpoint as the base (converter.training) may hold a LoRA whose alpha its files do not record.
    base_lora_alpha: float | None = None
    # ... and may lack its Hugging Face config (torchtitan, Megatron-LM): a folder or config.json that describes it.
    base_config: str | None = None

    def __post_init__(self) -> None:
        if self.qlora_base not in ("original", "dequantized"):
            raise RecipeError(f"qlora_base {self.qlora_base!r}: use original or dequantized")
        if self.qlora_quant not in ("nf4", "fp4"):
            raise RecipeError(f"qlora_quant {self.qlora_quant!r}: use nf4 or fp4")
        if not self.adapters and not _is_whole(self.base):  # a training run's state is whole
            raise RecipeError("recipe has no adapters: give at least one --adapter")
        for spec in self.adapters:
            if spec.lora_alpha is not None and not _is_number(spec.lora_alpha):
                raise RecipeError(f"adapter {spec.source}: lora_alpha {spec.lora_alpha!r} must be a number")
            if isinstance(spec.weight, dict) and not set(spec.weight) <= COMPONENT_WEIGHTS:
                unknown = sorted(set(spec.weight) - COMPONENT_WEIGHTS)
                raise RecipeError(
                    f"adapter {spec.source}: weight for unknown component {unknown[0]!r} "
                    f"(use {', '.join(sorted(COMPONENT_WEIGHTS))})"
                )
            for pattern in (*spec.include, *spec.exclude):
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise RecipeError(f"adapter {spec.source}: bad include/exclude regex {pattern!r} ({e})") from None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["adapters"] = [{k: v for k, v in asdict(a).items() if v not in ([], None)} for a in self.adapters]
        return {k: v for k, v in data.items() if v is not None}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict, where: str = "recipe") -> Recipe:
        if not isinstance(data, dict) or "base" not in data:
            raise RecipeError(f"{where}: needs a 'base' and a list of 'adapters'", file=_file(where))
        entries = data.get("adapters") or []
        if not isinstance(entries, list):
            raise RecipeError(f"{where}: 'adapters' must be a list (one entry per adapter)", file=_file(where))
        adapters = []
        for i, entry in enumerate(entries):
            if isinstance(entry, str):
                entry = {"source": entry}
            if not isinstance(entry, dict) or "source" not in entry:
                raise RecipeError(f"{where}: adapter entry {i + 1} needs a 'source'", file=_file(where))
            _check_types(entry, AdapterSpec, f"{where}: adapter entry {i + 1}", where)
            adapters.append(AdapterSpec(**entry))
        top = {k: v for k, v in data.items() if k != "adapters"}
        _check_types(top, cls, where, where)
        return cls(adapters=adapters, **top)

    @classmethod
    def load(cls, path: Path) -> Recipe:
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise RecipeError(f"{path}: recipe file not found", file=path) from None
        except IsADirectoryError:
            raise RecipeError(f"{path}: is a folder; give the recipe YAML file", file=path) from None
        except UnicodeDecodeError:
            raise RecipeError(f"{path}: not UTF-8 text; give a YAML recipe", file=path) from None
        except yaml.YAMLError as e:
            raise RecipeError(f"{path}: not valid YAML ({str(e).splitlines()[0]})", file=path) from None
        recipe = cls.from_dict(data, str(path))
        # Local paths in a recipe are relative to the recipe file, so a recipe travels with its folder.
        here = Path(path).resolve().parent
        recipe.base = _relative_to(recipe.base, here)
        for spec in recipe.adapters:
            spec.source = _relative_to(spec.source, here)
        if recipe.out:
            recipe.out = str(here / recipe.out) if not Path(recipe.out).is_absolute() else recipe.out
        return recipe


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _file(where: str) -> str | None:
    return None if where == "recipe" else where


# YAML types each recipe field takes (checked before the dataclass sees them, so a typo is one clear line).
_TYPES = {
    "source": (str,),
    "weight": (int, float, dict),
    "include": (list,),
    "exclude": (list,),
    "lora_alpha": (int, float),
    "base": (str,),
    "dtype": (str,),
    "out": (str,),
    "max_shard_size": (str, int),
    "allow_unmatched": (bool,),
    "allow_pickle": (bool,),
    "qlora": (bool,),
    "qlora_base": (str,),
    "qlora_quant": (str,),
    "qlora_blocksize": (int,),
    "qlora_double_quant": (bool,),
    "base_lora_alpha": (int, float),
    "base_config": (str,),
}


def _check_types(entry: dict, cls: type, what: str, where: str) -> None:
    known = {f.name for f in fields(cls)} - {"adapters"}
    for key, value in entry.items():
        if key not in known:
            raise RecipeError(f"{what}: unknown key {key!r} (known: {', '.join(sorted(known))})", file=_file(where))
        types = _TYPES.get(key, (object,))
        bad = not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
        if key in ("include", "exclude") and not bad:
            bad = not all(isinstance(p, str) for p in value)
        if key == "weight" and isinstance(value, dict) and not bad:
            bad = not all(_is_number(w) for w in value.values())
        if value is None and key in ("dtype", "out", "max_shard_size", "lora_alpha", "base_lora_alpha", "base_config"):
            bad = False
        if bad:
            want = " or ".join(
                "a list of strings" if t is list else {dict: "a mapping of component: weight"}.get(t, t.__name__)
                for t in types
            )
            raise RecipeError(f"{what}: {key} is {value!r}; it must be {want}", file=_file(where))


def _relative_to(spec: str, here: Path) -> str:
    candidate = here / spec
    return str(candidate) if not Path(spec).is_absolute() and candidate.exists() else spec


def _is_whole(base: str | None) -> bool:
    """A base that needs no adapter (a training checkpoint: converter.engine.readers)."""
    return any(reader.whole(base) for reader in base_readers())


def recorded_recipe(folder: str | Path) -> Recipe:
    """The recipe an output folder was merged from (its converter_recipe.yaml)."""
    path = Path(folder) / RECIPE_FILE
    if not path.is_file():
        raise RecipeError(
            f"{folder}: no {RECIPE_FILE} (not merged by converter?); give --base and --adapter", file=path
        )
    return Recipe.load(path)
