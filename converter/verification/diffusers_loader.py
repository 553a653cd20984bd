"""diffusers' pipelines and its LoRA loader, as the referee of a diffusion merge's tensors (diffusers_referee,
diffusers_parts) and the behaviour check (diffusion) both drive them: whether the loader reads these adapter files
right (asked before either runs), a pipeline loaded whole, as a single file, from the model components a folder
holds or weightless, and the adapters applied unmerged, with what diffusers says while it loads them.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path

from converter.engine.base_reader import open_base
from converter.engine.family import identify
from converter.engine.keymap import keymap_for
from converter.engine.recipe import Recipe
from converter.formats import load_adapter
from converter.formats.components import component_folders
from converter.io.safetensors_file import SafetensorsFile
from converter.verification.diffusers_names import for_the_unet, is_attn_procs_file
from converter.verification.peft_referee import hollow
from converter.verification.referee import in_one_line

MESSAGE_WIDTH = 120  # characters of a library's error message kept in the report
OPTIONAL = ("tokenizer", "tokenizer_2", "tokenizer_3", "safety_checker", "feature_extractor", "image_encoder")
MODEL_PARTS = ("unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3")
UP_FACTORS = (".lora_up.weight", ".lora_B.weight", ".lora.up.weight", ".lora_linear_layer.up.weight", "_lora.up.weight")


class LoaderRefused(Exception):
    """diffusers' LoRA loader cannot read an adapter: its refusals are ValueErrors, but its converters from other
    spellings also fail with KeyError or shape errors on files that lack modules or widths they expect."""


class Unbuildable(Exception):
    """A pipeline class that cannot be built from a folder's model components here."""


def diffusers_declines(recipe: Recipe, base: Path, adapters: list[Path]) -> str | None:
    """Why diffusers' loader cannot stand for these adapters (None: it can). Asked, not caught."""
    if any(spec.include or spec.exclude for spec in recipe.adapters):
        return "diffusers' LoRA loader cannot restrict an adapter to some tensors (include/exclude)"
    if not base.is_file() and not (base / "model_index.json").is_file():
        return "the base is neither a diffusers folder nor a single file"

    if folders := [a.name for a in adapters if component_folders(a)]:
        return f"diffusers' loader reads a LoRA file, not PEFT folders per component ({', '.join(folders)})"
    if folders := [a.name for a in adapters if (a / "adapter_config.json").is_file()]:
        return (f"diffusers' loader takes a LoRA's scale from the file's own metadata, not from a PEFT folder's "
                f"adapter_config.json ({', '.join(folders)})")  # fmt: skip
    if dora := lycoris_dora(adapters):
        return f"diffusers' loader drops the dora_scale tensors of {dora} (LyCORIS DoRA) and would be a wrong referee"
    return unread_spelling(adapters)


def unread_spelling(sources: list[Path]) -> str | None:
    """The first adapter file whose family's keymap says diffusers' loader does not read its spelling, as a reason
    (its loaders table is what the family tests check against diffusers itself); None when none is such."""
    for path in sources:
        if not (path.is_file() and path.suffix == ".safetensors"):
            continue
        identity = identify(load_adapter(path, require_scale=False))
        if identity is None or identity.family is None:
            continue
        table = identity.family.lokr_loaders if identity.lokr else identity.family.loaders
        if "diffusers" in table and "diffusers" not in identity.loads_in():
            return (f"diffusers' loader does not read {path.name} as it is spelt ({identity.spelling} names of "
                    f"{identity.family.title}, by the keymap's loaders)")  # fmt: skip
    return None


def lycoris_dora(sources: list[Path]) -> str | None:
    """The first single-file adapter with LyCORIS `dora_scale` tensors (read from its header only), else None."""
    for path in sources:
        is_file = path.is_file() and path.suffix == ".safetensors"
        if is_file and any(k.endswith(".dora_scale") for k in SafetensorsFile(path).tensors):
            return path.name
    return None


def load_pipeline(folder: Path):
    """The whole pipeline when its folder has one (UNet, VAE, scheduler: images can be made), else the pipeline
    class built from the model components the folder holds (None for the rest), enough for diffusers' loader."""
    import torch
    from diffusers import DiffusionPipeline
    from diffusers.utils import logging as dlog

    index = json.loads((folder / "model_index.json").read_text())
    level = dlog.get_verbosity()
    dlog.set_verbosity_error()
    try:
        if is_complete(folder):
            absent = {k: None for k in OPTIONAL if k not in index or index[k] == [None, None]}
            pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32, **absent)
            pipe.set_progress_bar_config(disable=True)
            return pipe
        return partial_pipeline(folder, index)
    finally:
        dlog.set_verbosity(level)


def load_single_file(file: Path, config: str | None):
    """A single-file checkpoint as its family's diffusers pipeline (`from_single_file`). Parts the file does not
    carry and the pipeline can go without (tokenizers, safety checker) are None; a VAE missing from the file is
    the config folder's, when that is a local folder holding one."""
    import inspect

    import diffusers
    import torch
    from diffusers.utils import logging as dlog

    checkpoint = open_base(file)
    keymap = keymap_for(checkpoint.config)
    if not keymap.pipelines:
        raise ValueError(f"no diffusers pipeline for the {keymap.name} family")
    cls = getattr(diffusers, keymap.pipelines[0])
    params = inspect.signature(cls.__init__).parameters
    kwargs = {"torch_dtype": torch.float32, **{k: None for k in OPTIONAL if k in params}}
    if config:
        kwargs["config"] = str(config)
        vae = Path(config) / "vae"
        if vae.is_dir() and not any(k.startswith("first_stage_model.") for k in checkpoint.names()):
            kwargs["vae"] = diffusers.AutoencoderKL.from_pretrained(vae, torch_dtype=torch.float32)
    level = dlog.get_verbosity()
    dlog.set_verbosity_error()
    try:
        pipe = cls.from_single_file(str(file), **kwargs)
    finally:
        dlog.set_verbosity(level)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def is_complete(folder: Path) -> bool:
    """A pipeline folder that can make images: a denoiser, a VAE and a scheduler."""
    denoiser = any((folder / c).is_dir() for c in ("unet", "transformer"))
    return denoiser and all((folder / c).is_dir() for c in ("vae", "scheduler"))


def partial_pipeline(folder: Path, index: dict, empty: bool = False):
    """The pipeline class built from the model components the folder holds (None for the rest): enough for
    diffusers' loader. `empty`: each model's module tree without weights (peft_referee.hollow)."""
    import inspect

    import diffusers

    cls = getattr(diffusers, index["_class_name"])
    parts = {name: component_model(folder, name, index, empty) for name in MODEL_PARTS
             if (folder / name / "config.json").is_file()}  # fmt: skip
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    if missing := [p for p in parts if p not in params]:
        raise Unbuildable(f"diffusers' {cls.__name__} takes no {', '.join(missing)} when built (a modular pipeline)")
    try:
        return cls(**{p: parts.get(p) for p in params})
    except Exception as e:  # noqa: BLE001 - diffusers' own constructor, given None for the parts the folder lacks
        raise Unbuildable(f"diffusers' {cls.__name__} cannot be built here ({in_one_line(e, MESSAGE_WIDTH)})") from None


def component_model(folder: Path, name: str, index: dict, empty: bool = False):
    """One model component of a pipeline folder, loaded in float32, or (`empty`) its module tree only."""
    import diffusers
    import torch
    import transformers

    cfg = json.loads((folder / name / "config.json").read_text())
    library, class_name = (index.get(name) or [None, None])[:2]
    if not class_name:
        library, class_name = (
            ("diffusers", cfg["_class_name"]) if "_class_name" in cfg else ("transformers", cfg["architectures"][0])
        )
    cls = getattr(diffusers if library == "diffusers" else transformers, class_name)
    if not empty:
        return cls.from_pretrained(folder / name, torch_dtype=torch.float32).eval()
    from accelerate import init_empty_weights

    with init_empty_weights():
        if library == "diffusers":
            model = cls.from_config(cls.load_config(folder / name))
        else:
            model = cls._from_config(transformers.AutoConfig.from_pretrained(folder / name), dtype=torch.float32)
    hollow(model)
    return model.eval()


def apply_adapters(pipe, recipe: Recipe, sources: list[Path]) -> str | None:
    """load_lora_weights per adapter, then set_adapters with each one's per-component strengths; returns why the
    pipeline's forward is not the adapters as trained (None: it is), from what diffusers said while loading."""
    ignored, left_out, names = 0, [], []
    for i, local in enumerate(sources):
        name = f"adapter_{i}"
        alphas, keys = load_one(pipe, local, name)
        ignored, left_out = ignored + alphas, left_out + keys
        names.append(name)
    if ignored:
        return ignored_alphas(ignored)
    if left_out:
        return (f"diffusers' loader leaves {len(left_out)} LoRA tensor(s) of the file out ({', '.join(left_out[:2])}"
                f"{', ...' if len(left_out) > 2 else ''}), so its forward is not the adapter as trained")  # fmt: skip
    per_component = pipe.get_list_adapters()
    present = {n for adapters in per_component.values() for n in adapters}
    if nothing := [local.name for local, n in zip(sources, names, strict=True) if n not in present]:
        return f"diffusers' loader applies nothing of {', '.join(nothing)} to this pipeline"
    for local, name in zip(sources, names, strict=True):
        if dropped := dropped_factors(pipe, name, local):
            return dropped
    weights = [{c: spec.weight_for(c) for c in per_component} for spec in recipe.adapters]
    pipe.set_adapters(names, adapter_weights=weights)
    return None


def ignored_alphas(count: int) -> str:
    return (f"diffusers' loader ignores the per-module alphas of {count} modules of this file (its "
            "alpha_pattern names never match), so its forward is not the adapter as trained")  # fmt: skip


def load_one(pipe, local: Path, name: str) -> tuple[int, list[str]]:
    """load_lora_weights of one adapter as `name`: (how many per-module alphas diffusers says it ignores, the
    LoRA keys it says it left out); LoaderRefused when diffusers raises. A UNet LoRA of attention processors
    named without a component (save_attn_procs before PEFT) is given under `unet.` (diffusers_names)."""
    file = local / "pytorch_lora_weights.safetensors" if local.is_dir() else local
    unet = getattr(pipe, "unet_name", "unet")
    if getattr(pipe, unet, None) is not None and is_attn_procs_file(file):
        return heard(local.name, lambda: pipe.load_lora_weights(for_the_unet(file, unet), adapter_name=name))
    if local.is_dir():
        return heard(local.name, lambda: pipe.load_lora_weights(str(local), adapter_name=name))
    return heard(local.name, lambda: pipe.load_lora_weights(str(local.parent), weight_name=local.name,
                                                            adapter_name=name))  # fmt: skip


def heard(what: str, load: Callable[[], object]) -> tuple[int, list[str]]:
    """Run one of diffusers' LoRA loaders on `what`: (how many per-module alphas it says it ignores, the LoRA keys
    it says it left out), from its warnings and its logger; LoaderRefused when it raises."""
    left_out = []
    said, library = _Said(), logging.getLogger("diffusers")
    level = library.level
    library.addHandler(said)
    library.setLevel(min(level or logging.WARNING, logging.WARNING))  # its warnings reach the handler
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:  # only diffusers' own code runs in here
                load()
            except Exception as e:  # noqa: BLE001 - see LoaderRefused
                raise LoaderRefused(f"{what}: {type(e).__name__}: {in_one_line(e, MESSAGE_WIDTH)}") from None
    finally:
        library.removeHandler(said)
        library.setLevel(level)
    ignored = sum(str(w.message).count("', '") + 1 for w in caught
                  if "alpha_pattern keys did not match" in str(w.message))  # fmt: skip
    for text in said.lines:
        for marker in ("led to unexpected keys found in the model:", "led to missing keys in the model:"):
            if marker in text:
                left_out += [k.strip() for k in text.split(marker, 1)[1].split(". ")[0].split(",")]
    return ignored, left_out


class _Said(logging.Handler):
    """What diffusers' logger says while attached (its loader reports the keys it left out there)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def dropped_factors(pipe, name: str, source: Path) -> str | None:
    """Why diffusers' forward is not all of the file: its converters drop modules they do not know without a word
    (a kohya Flux file's T5 `lora_te3_` modules). Counted without any name mapping: the elements of the file's LoRA
    up factors (read from its header) against those of the up factors diffusers loaded as `name` (a fused module
    it splits keeps its rows); None when they agree or the file is not a safetensors file of such factors."""
    file = source / "pytorch_lora_weights.safetensors" if source.is_dir() else source
    if file.suffix != ".safetensors" or not file.is_file():
        return None
    ups, in_file = up_factors(file)
    loaded = loaded_elements(pipe, name)
    if loaded >= in_file:
        return None
    return (f"diffusers' loader leaves part of {source.name} out without a word: it loads {loaded} of the "
            f"{in_file} elements of the file's {ups} LoRA up factors, so its forward is not the adapter as "
            "trained")  # fmt: skip


def up_factors(file: Path) -> tuple[int, int]:
    """(how many LoRA up factors, their elements) of a safetensors file, from its header."""
    import math

    ups = [t for k, t in SafetensorsFile(file).tensors.items() if k.endswith(UP_FACTORS)]
    return len(ups), sum(math.prod(t.shape) for t in ups)


def loaded_elements(pipe, name: str) -> int:
    """The elements of the LoRA up factors diffusers injected as adapter `name`, in every model of the pipeline."""
    from torch import nn

    loaded = 0
    for model in (m for m in pipe.components.values() if isinstance(m, nn.Module)):
        for module in model.modules():
            for factors in (getattr(module, "lora_B", None), getattr(module, "lora_embedding_B", None)):
                if factors is not None and name in factors:
                    up = factors[name]
                    loaded += (up.weight if isinstance(up, nn.Module) else up).numel()
    return loaded
