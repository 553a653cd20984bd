"""The parts of a LoRA file diffusers reads, where its pipeline's loader does not read the whole file.

A kohya file's modules come in parts by their prefix (`lora_unet_`, `lora_te1_`, `lora_te3_` ...), a diffusers
file's by component (`transformer.`, `text_encoder.` ...). diffusers' Flux converter drops the T5 modules of a kohya
file without a word, and its SD3 loader converts no kohya file at all, so the pipeline's loader cannot referee such a
file whole. Each part is then loaded on its own, as its own adapter, into a fresh weightless pipeline:

- a part the pipeline's loader reads whole is refereed by diffusers;
- a kohya text-encoder part it reads nothing of goes through diffusers' own kohya text-encoder conversion (the one
  its SD 1.x / SDXL loaders use: `lora_te_` / `lora_te1_` -> text_encoder, `lora_te2_` -> text_encoder_2) into the
  pipeline's `load_lora_into_text_encoder`, for the text encoders its loader takes a LoRA for (SD3's CLIP-L and
  OpenCLIP-G); read whole, diffusers referees it;
- a part no diffusers code reads (T5 or LLM text-encoder modules, SD3's kohya MMDiT) is left to the published
  formula, tensor by tensor, labelled;
- a kohya part whose alphas differ by module (which diffusers misreads whole) is loaded as one copy per alpha, the
  other modules' up factors zeroed (one_alpha_each);
- a part diffusers reads only in part, or still misreads, makes diffusers decline the whole file.

Read whole is counted as the loader's own check is (diffusers_loader.dropped_factors): the elements of the part's
LoRA up factors against those of the up factors diffusers injected under the part's adapter name, no name mapping
involved.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from converter.engine.recipe import Recipe
from converter.io.safetensors_file import SafetensorsFile
from converter.verification.diffusers_loader import (
    LoaderRefused,
    dropped_factors,
    heard,
    ignored_alphas,
    load_one,
    loaded_elements,
)
from converter.verification.formula import REFERENCE, FormulaReferee
from converter.verification.referee import Expectation, RefereeUnavailable

# the kohya text-encoder prefixes diffusers' kohya conversion (_convert_non_diffusers_lora_to_diffusers) reads
KOHYA_TEXT_ENCODERS = ("lora_te_", "lora_te1_", "lora_te2_")


def part_of(key: str) -> str:
    """A file key's part: kohya's prefix (`lora_te3`), else its first dotted name (`text_encoder_2`)."""
    if key.startswith("lora_"):
        return "_".join(key.split("_", 2)[:2])
    return key.split(".", 1)[0]


def spelt(part: str) -> str:
    """A part as its keys begin: `lora_te3_`, `text_encoder_3.`."""
    return part + ("_" if part.startswith("lora_") else ".")


@dataclass
class Parts:
    """What diffusers loaded, part by part: its adapter `names` with each one's recipe entry (`specs`), the
    keys it read none of per adapter (`unread`), the parts named (`unread_parts`), and how each part was read."""

    names: list[str] = field(default_factory=list)
    specs: list = field(default_factory=list)
    unread: dict[int, set[str]] = field(default_factory=dict)
    unread_parts: list[str] = field(default_factory=list)  # `lora_te3_`, `text_encoder_3.`: as the keys begin
    converted: list[str] = field(default_factory=list)  # parts read by diffusers' kohya text-encoder conversion


def load_parts(pipe, recipe: Recipe, sources: list[Path], scratch: Path) -> Parts:
    """Each part of each adapter file loaded into `pipe` as its own adapter, then set_adapters with the recipe's
    per-component strengths; RefereeUnavailable where a part is read only in part or no part is read."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    found = Parts()
    for i, (source, spec) in enumerate(zip(sources, recipe.adapters, strict=True)):
        if not (source.is_file() and source.suffix == ".safetensors"):
            raise RefereeUnavailable(f"{source.name} is not one safetensors file whose parts can be loaded apart")
        groups: dict[str, set[str]] = {}
        for key in SafetensorsFile(source).tensors:
            groups.setdefault(part_of(key), set()).add(key)
        for j, (part, keys) in enumerate(sorted(groups.items())):
            with safe_open(source, "pt") as f:
                tensors, metadata = {k: f.get_tensor(k) for k in sorted(keys)}, f.metadata()
            for k, one_alpha in enumerate(one_alpha_each(tensors)):
                name, path = f"adapter_{i}_{j}_{k}", scratch / f"{i}-{j}-{k}" / source.name
                path.parent.mkdir(parents=True)
                save_file(one_alpha, path, metadata=metadata)
                how = _read_part(pipe, path, name, part, keys)
                if how is None:
                    found.unread.setdefault(i, set()).update(keys)
                    found.unread_parts.append(spelt(part))
                    break
                found.names.append(name)
                found.specs.append(spec)
                if how == "converted" and spelt(part) not in found.converted:
                    found.converted.append(spelt(part))
    if not found.names:
        raise RefereeUnavailable("diffusers reads no part of the adapters")
    per_component = pipe.get_list_adapters()
    pipe.set_adapters(found.names, adapter_weights=[{c: s.weight_for(c) for c in per_component} for s in found.specs])
    return found


def one_alpha_each(tensors: dict) -> list[dict]:
    """A kohya part whose modules' alphas differ, as one copy per alpha (modules with none: one copy without
    alphas), each with every module's names and the up factors of the other modules' zeroed: their sum is the part.
    diffusers' loader keys per-module alphas under names PEFT never matches and gives every module the commonest
    one, but it reads one alpha right; and its SDXL loader places kohya's SGM blocks by the keys the file has, so
    each copy keeps them all. A part whose modules share their alpha is itself."""
    import torch

    modules = {k.split(".", 1)[0] for k in tensors if k.startswith("lora_")}
    alphas = {m: float(tensors[f"{m}.alpha"]) if f"{m}.alpha" in tensors else None for m in modules}
    if len(set(alphas.values())) <= 1:
        return [tensors]
    copies = []
    for alpha in sorted(set(alphas.values()), key=lambda a: (a is None, a or 0.0)):
        copy = {}
        for key, value in tensors.items():
            module = key.split(".", 1)[0]
            if key.endswith(".alpha"):
                if alpha is not None:
                    copy[key] = torch.tensor(alpha, dtype=value.dtype)
            elif key.endswith(".lora_up.weight") and alphas.get(module, alpha) != alpha:
                copy[key] = torch.zeros_like(value)
            else:
                copy[key] = value
        copies.append(copy)
    return copies


def _read_part(pipe, path: Path, name: str, part: str, keys: set[str]) -> str | None:
    """How diffusers read the part as `name`: "loaded" (the pipeline's loader), "converted" (its kohya
    text-encoder conversion), None (nothing of it); RefereeUnavailable where it reads it in part or wrong."""
    try:
        ignored, left_out = load_one(pipe, path, name)
    except LoaderRefused as e:
        if loaded_elements(pipe, name):
            why = f"diffusers' loader fails on the {part} part after loading some of it ({e})"
            raise RefereeUnavailable(why) from None
        ignored, left_out = 0, []
    if ignored:
        raise RefereeUnavailable(ignored_alphas(ignored))
    if left_out:
        raise RefereeUnavailable(f"diffusers' loader leaves {len(left_out)} LoRA tensor(s) of the {part} part out "
                                 f"({', '.join(left_out[:2])})")  # fmt: skip
    how = "loaded"
    if not loaded_elements(pipe, name) and all(k.startswith(KOHYA_TEXT_ENCODERS) for k in keys):
        try:
            heard_of = _kohya_text_encoders(pipe, path, name)
        except LoaderRefused as e:
            raise RefereeUnavailable(f"diffusers' text-encoder loader fails on the {part} part ({e})") from None
        if heard_of is not None:
            how, (ignored, left_out) = "converted", heard_of
            if ignored:
                raise RefereeUnavailable(ignored_alphas(ignored))
            if left_out:
                raise RefereeUnavailable(f"diffusers' text-encoder loader leaves {len(left_out)} LoRA tensor(s) of "
                                         f"the {part} part out ({', '.join(left_out[:2])})")  # fmt: skip
    if not loaded_elements(pipe, name):
        return None
    if dropped := dropped_factors(pipe, name, path):
        raise RefereeUnavailable(dropped)
    return how


def _kohya_text_encoders(pipe, path: Path, name: str) -> tuple[int, list[str]] | None:
    """diffusers' kohya text-encoder conversion of the part, loaded by the pipeline's load_lora_into_text_encoder
    into the text encoders it names, when the pipeline's loader takes a LoRA for each of them: what diffusers said
    while loading (diffusers_loader.heard), or None when it does not read the part this way."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_lora_to_diffusers
    from safetensors.torch import load_file

    try:
        state, alphas = _convert_non_diffusers_lora_to_diffusers(load_file(path))
    except Exception:  # noqa: BLE001 - diffusers' converter refusing the part: it does not read it
        return None
    components = sorted({k.split(".", 1)[0] for k in state})
    loadable = set(getattr(pipe, "_lora_loadable_modules", ()))
    if not components or any(c not in loadable or getattr(pipe, c, None) is None for c in components):
        return None
    ignored, left_out = 0, []
    for component in components:
        more = heard(path.name, lambda c=component: type(pipe).load_lora_into_text_encoder(
            state, network_alphas=alphas, text_encoder=getattr(pipe, c), prefix=c, adapter_name=name,
            _pipeline=pipe))  # fmt: skip
        ignored, left_out = ignored + more[0], left_out + more[1]
    return ignored, left_out


def formula_part(recipe: Recipe, base: Path, adapters: list[Path], parts: Parts) -> dict[str, Expectation]:
    """The published formula's expectations for the tensors only unread keys change, each labelled; an output
    tensor changed both by keys diffusers read and by keys it did not cannot be split: RefereeUnavailable."""
    referee = FormulaReferee(recipe, base, adapters, "diffusers reads no part of these modules")

    def unread(p) -> bool:
        inner = getattr(p.patch, "inner", p.patch)
        return all(s in parts.unread.get(p.adapter, ()) for s in inner.sources)

    mine = set()
    for o in referee.plan.outputs:
        owners = {unread(p) for p in o.patches}
        if owners == {True, False}:
            raise RefereeUnavailable(f"{o.name} is changed both by modules diffusers reads and by modules it does "
                                     "not (" + ", ".join(parts.unread_parts) + ")")  # fmt: skip
        if owners == {True}:
            mine.add(o.name)
    return {name: replace(rule, module=f"{rule.module} ({REFERENCE})")
            for name, rule in referee.expectations(only=mine).items()}  # fmt: skip
