"""diffusers as the referee of a diffusion merge's tensors, and PEFT itself for multi-component PEFT folders.

diffusers' own loader (`load_lora_weights`: its key conversion of kohya / LyCORIS / ai-toolkit files, its alphas,
`set_adapters` for per-component strengths) injects PEFT layers into a pipeline whose models are module trees
without weights (peft_referee.hollow): the denoiser and the text encoders it loads a LoRA for. Each layer's merge
is then replayed on the base's rows like PEFT's (peft_referee.PeftLayers), the tensor named by the component and
the file key the model's parameter is loaded from (model_class.loaded_names: transformers' own renames on load,
such as a CLIPTextModel's dropped `text_model.`). Where diffusers reads a file wrong, in part or not at all
(include/exclude, LyCORIS DoRA, modules its converters drop, a single-file base whose tensor names are not
diffusers' module names), it declines and the published formula referees. A file it reads only some parts of (by
kohya prefix or component), or misreads whole (kohya's per-module alphas), is loaded part by part, one alpha at a
time (diffusers_parts): diffusers referees the parts it reads right, the formula the tensors of the parts no
diffusers code reads, each such tensor labelled.
"""

from __future__ import annotations

import json
from pathlib import Path

from converter.engine.base_reader import open_base
from converter.engine.model_class import LoadingRulesUnreadable, loaded_names
from converter.engine.recipe import Recipe
from converter.formats.components import component_folders
from converter.io.scratch import temp_folder
from converter.verification.diffusers_loader import (
    MODEL_PARTS,
    LoaderRefused,
    Unbuildable,
    apply_adapters,
    component_model,
    partial_pipeline,
)
from converter.verification.diffusers_parts import Parts, formula_part, load_parts
from converter.verification.formula import REFERENCE
from converter.verification.loading import peft_refusals
from converter.verification.peft_referee import PeftLayers, hollow
from converter.verification.referee import Expectation, RefereeInfo, RefereeUnavailable, first_line


class DiffusersReferee:
    """diffusers' loader applying the adapters to a weightless copy of the base pipeline; PEFT's merge per layer."""

    def __init__(self, recipe: Recipe, base: Path, adapters: list[Path]):
        if base.is_file():
            raise RefereeUnavailable("a single-file base's tensors are not named as diffusers' modules")
        names = _base_names(base)
        pipe, parts, renamed = _weightless(base, names)
        try:
            wrong = apply_adapters(pipe, recipe, adapters)
        except LoaderRefused as e:
            raise RefereeUnavailable(f"diffusers cannot apply the adapters ({first_line(e, 160)})") from None
        adapter_names, specs = [f"adapter_{i}" for i in range(len(adapters))], recipe.adapters
        self.formula: dict[str, Expectation] = {}
        notes: list[str] = []
        if wrong:  # the file's parts apart: diffusers for those it reads whole, the formula for those it reads none of
            pipe, parts, renamed = _weightless(base, names)
            try:
                with temp_folder("lora-parts") as scratch:  # each part a file, as diffusers' loader reads one
                    split = load_parts(pipe, recipe, adapters, scratch)
                self.formula = formula_part(recipe, base, adapters, split) if split.unread else {}
            except RefereeUnavailable as e:
                raise RefereeUnavailable(f"{wrong} (its parts apart: {e})") from None
            adapter_names, specs, notes = split.names, split.specs, _notes(split, self.formula)
        self.parts = [RenamedLayers(model, c, renamed[c], adapter_names, specs, names)
                      for c, model in parts.items()]  # fmt: skip
        self.info = RefereeInfo(
            "diffusers",
            "diffusers' own LoRA loader (its key conversion and alphas, set_adapters for per-component weights), "
            "PEFT's merge of each layer it injected, in float64 (float32 for 16-bit outputs)",
            independent=not self.formula,
            notes=notes,
            shared=f"the {REFERENCE}, its module placement from converter's keymap as in the merge, for the "
                   f"{len(self.formula)} tensor(s) of modules no diffusers loader reads" if self.formula else None,
        )  # fmt: skip

    def expectations(self) -> dict[str, Expectation]:
        out = {k: v for part in self.parts for k, v in part.expectations().items()}
        if both := sorted(set(out) & set(self.formula)):
            raise RefereeUnavailable(f"{both[0]} is changed both by modules diffusers reads and by modules it does not")
        return {**out, **self.formula}


def _weightless(base: Path, names: set[str]):
    """The base pipeline without weights, its model components, and each one's names as loaded -> file keys."""
    try:
        pipe = partial_pipeline(base, json.loads((base / "model_index.json").read_text()), empty=True)
    except Unbuildable as e:
        raise RefereeUnavailable(str(e)) from None
    parts = {c: getattr(pipe, c) for c in MODEL_PARTS if getattr(pipe, c, None) is not None}
    return pipe, parts, {c: _loaded_names(model, c, names) for c, model in parts.items()}  # before PEFT wraps them


def _notes(split: Parts, formula: dict) -> list[str]:
    """What the report says of a file diffusers read part by part."""
    notes = []
    if split.converted:
        notes.append(f"the pipeline's own loader converts no kohya {', '.join(split.converted)} modules here; "
                     "diffusers' kohya text-encoder conversion (its SD 1.x / SDXL one) and the pipeline's "
                     "load_lora_into_text_encoder read them")  # fmt: skip
    if split.unread_parts:
        components = sorted({name.split("/", 1)[0] for name in formula})
        notes.append(f"no diffusers loader reads the {', '.join(sorted(set(split.unread_parts)))} modules: the "
                     f"{REFERENCE} referees the {len(formula)} tensor(s) they change ({', '.join(components) or 'none'}"
                     "), module placement from converter's keymap, as in the merge")  # fmt: skip
    return notes


class PeftComponentsReferee:
    """Multi-component PEFT folders (`unet/`, `text_encoder/` ... each with its adapter_config.json): PEFT itself
    injects each component's adapter into that component's weightless model and loads its weights."""

    def __init__(self, recipe: Recipe, base: Path, adapters: list[Path]):
        if base.is_file() or not (base / "model_index.json").is_file():
            raise RefereeUnavailable("a multi-component PEFT folder needs a diffusers pipeline folder as its base")
        index = json.loads((base / "model_index.json").read_text())
        names = _base_names(base)
        adapter_names = [f"adapter{i}" for i in range(len(adapters))]
        models: dict[str, object] = {}
        renamed: dict[str, dict[str, str]] = {}
        for name, spec, folder in zip(adapter_names, recipe.adapters, adapters, strict=True):
            for sub in component_folders(folder):
                if sub.name not in models:
                    models[sub.name] = _component(base, sub.name, index)
                    renamed[sub.name] = _loaded_names(models[sub.name], sub.name, names)  # before PEFT wraps it
                _inject(models[sub.name], sub, name, spec.weight_for(sub.name), renamed[sub.name])
        self.parts = [RenamedLayers(m, c, renamed[c], adapter_names, recipe.adapters, names)
                      for c, m in models.items()]  # fmt: skip
        self.info = RefereeInfo(
            "PEFT",
            "PEFT's own adapter per component (inject_adapter_in_model, its weights loaded by PEFT), PEFT's merge "
            "of each layer, in float64 (float32 for 16-bit outputs)",
        )

    def expectations(self) -> dict[str, Expectation]:
        return {k: v for part in self.parts for k, v in part.expectations().items()}


class RenamedLayers:
    """The PEFT layers of one pipeline component whose parameters transformers renames on load (a CLIPTextModel
    without the `text_model.` of its files): PEFT's modules are located by the model's own names, their
    expectations named by the base's files (what the merge writes). `renamed`: model name -> file key."""

    def __init__(self, model, component: str, renamed: dict[str, str], adapter_names: list[str], specs: list,
                 base_names: set[str]):  # fmt: skip
        ns = f"{component}/"
        self.to_file = {ns + k: ns + v for k, v in renamed.items() if k != v}
        to_model = {v: k for k, v in self.to_file.items()}
        self.layers = PeftLayers(model, "", ns, adapter_names, specs, {to_model.get(n, n) for n in base_names})

    def expectations(self) -> dict[str, Expectation]:
        from dataclasses import replace

        return {self.to_file.get(name, name): replace(rule, base_name=self.to_file.get(rule.base_name, rule.base_name))
                for name, rule in self.layers.expectations().items()}  # fmt: skip


def _loaded_names(model, component: str, base_names: set[str]) -> dict[str, str]:
    """The component's parameter names -> the base's file keys they load from, by transformers' own rules."""
    ns = f"{component}/"
    try:
        names = loaded_names(model, [n[len(ns) :] for n in base_names if n.startswith(ns)])
        return {k: v for k, v in names.items() if v is not None}  # a fused weight has no one file key
    except LoadingRulesUnreadable as e:
        raise RefereeUnavailable(f"{component}: {e}") from None


def _component(base: Path, name: str, index: dict):
    if not (base / name / "config.json").is_file():
        raise RefereeUnavailable(f"the base has no {name} for the adapter's {name}/ folder")
    return component_model(base, name, index, empty=True)


def _inject(model, folder: Path, name: str, weight: float, renamed: dict[str, str]) -> None:
    """PEFT's adapter from `folder` into `model` as `name`, scaled by the recipe's weight (PEFT's set_scale). Its
    module paths as the files spell them (saved before transformers 5: `text_model.encoder...` of a CLIPTextModel)
    are the model's by transformers' own renames (`renamed`: model name -> file key), which PEFT does not apply
    to models whose conversion transformers keys by class."""
    from peft import LoraConfig, inject_adapter_in_model, load_peft_weights, set_peft_model_state_dict

    modules = _module_paths(renamed)
    config = LoraConfig.from_pretrained(folder)
    if modules and isinstance(config.target_modules, list | set):
        config.target_modules = sorted({modules.get(t, t) for t in config.target_modules})
    with peft_refusals():
        inject_adapter_in_model(config, model, adapter_name=name)
        weights = _model_paths(load_peft_weights(str(folder), device="cpu"), renamed)
        result = set_peft_model_state_dict(model, weights, adapter_name=name)
    unplaced = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if unplaced:
        raise RefereeUnavailable(f"PEFT places {len(unplaced)} tensors of {folder} nowhere, e.g. {unplaced[0]}")
    hollow(model)
    for module in model.modules():
        if hasattr(module, "set_scale") and name in getattr(module, "scaling", {}):
            module.set_scale(name, weight)


def _model_paths(weights: dict, renamed: dict[str, str]) -> dict:
    """PEFT's saved keys (`base_model.model.<module>.lora_A.weight`, a modules_to_save module's own
    `<module>.weight`) as PEFT looks them up in a model it injected into (no `base_model.model.`), each path the
    files spell as the model's (`renamed`: model name -> file key)."""
    params, modules = {f: m for m, f in renamed.items() if m != f}, _module_paths(renamed)
    out = {}
    for key, value in weights.items():
        path = key.removeprefix("base_model.model.")
        module, sep, tail = path.partition(".lora_")
        out[f"{modules.get(module, module)}{sep}{tail}" if sep else params.get(path, path)] = value
    return out


def _module_paths(renamed: dict[str, str]) -> dict[str, str]:
    """File module path -> the model's, for the modules whose weight transformers renames on load."""
    return {f.removesuffix(".weight"): m.removesuffix(".weight") for m, f in renamed.items()
            if m != f and f.endswith(".weight") and m.endswith(".weight")}  # fmt: skip


def _base_names(base: Path) -> set[str]:
    return set(open_base(base).names())
