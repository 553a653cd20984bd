"""The three writers: kohya (one file, a real `.alpha` per module), PEFT (a folder per component) and
diffusers (`pytorch_lora_weights.safetensors` with its LoraConfig in the metadata). All atomic.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from pathlib import Path

import torch

from converter.conversion.modules import LoraModule
from converter.engine.keymap import flatten
from converter.engine.writer import atomic_folder, check_output_target
from converter.errors import AdapterFormatError, BadInputError, OutputError, UsageError
from converter.io.scratch import owned_name, stop_here, sweep

DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
# kohya prefixes per output component (sd-scripts networks/lora.py, lora_flux.py; docs/FORMATS.md §1)
# "denoiser" = a denoiser under its original (LDM, BFL, Wan ...) names; "transformer" = a DiT under diffusers' names,
# which kohya-style files spell lora_transformer_ (OneTrainer; read by ComfyUI and diffusers, §5, §6).
KOHYA_PREFIX = {"unet": "lora_unet_", "denoiser": "lora_unet_", "transformer": "lora_transformer_"}
# kohya's CLIP text-encoder names come from transformers 4 module paths, which start with `text_model.`
# (lora_te_text_model_encoder_layers_0_..., the only spelling ComfyUI/A1111 look up; docs/FORMATS.md §1, §5);
# transformers 5 checkpoints and modules drop it. T5 (`encoder.block.`) never had it.
KOHYA_TEXT_MODEL = re.compile(r"(encoder\.layers|embeddings|final_layer_norm)\.")


def write(
    modules: list[LoraModule],
    to: str,
    out: Path,
    *,
    force: bool = False,
    source: dict | None = None,
    base_model: str | None = None,
    svd: dict[str, float] | None = None,
    components: set[str] | None = None,
    denoiser_prefix: str = "diffusion_model.",
) -> list[str]:
    """Write `modules` in format `to` at `out` (a file for kohya/ComfyUI, a folder otherwise), atomically.
    `components`: the base's parts, so a kohya file for a two-encoder model says lora_te1_ even when only one is
    adapted; `denoiser_prefix`: what a ComfyUI file puts before the denoiser's names (the family keymap's target)."""
    if not modules:
        raise AdapterFormatError("the adapter has no LoRA modules to convert")
    info = {**(source or {}), "tool": "converter"}
    if svd:
        info["svd_relative_errors"] = {k: round(v, 8) for k, v in sorted(svd.items())}
    if to in ("kohya", "comfyui"):
        if to == "kohya":
            tensors, meta = kohya_tensors(modules, info, components or set())
        else:
            tensors, meta = comfyui_tensors(modules, info, components or set(), denoiser_prefix)
        _atomic_file(out, tensors, meta, force)
        return [out.name]
    with atomic_folder(out, force) as tmp:
        writer = write_peft if to == "peft" else write_diffusers
        return writer(modules, tmp, info, base_model)


def _atomic_file(out: Path, tensors: dict, metadata: dict, force: bool) -> None:
    from safetensors.torch import save_file

    check_output_target(out, force)
    if out.is_dir():
        raise OutputError(
            f"{out}: is a folder; a kohya LoRA is one file (give a path ending in .safetensors)", path=out
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep(out.parent, print, f".{out.name}.")
    tmp = out.parent / owned_name("file", f".{out.name}.")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        stop_here("staged")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _most_common(values: list) -> object:
    return Counter(values).most_common(1)[0][0]


def kohya_prefix(component: str | None, components: set) -> str:
    """sd-scripts' prefixes: lora_unet for every denoiser, lora_te for a single text encoder, lora_te1/2/3 when
    there are several (docs/FORMATS.md §1)."""
    if component in KOHYA_PREFIX:
        return KOHYA_PREFIX[component]
    if component == "text_encoder":
        return "lora_te1_" if components & {"text_encoder_2", "text_encoder_3"} else "lora_te_"
    if component and component.startswith("text_encoder_"):
        return f"lora_te{component.rsplit('_', 1)[1]}_"
    raise UsageError(
        "cannot tell which part of the model the adapter is for (kohya names start with lora_unet_ or lora_te_): "
        "pass --component unet|transformer|text_encoder|text_encoder_2"
    )


def kohya_tensors(modules: list[LoraModule], info: dict, base_components: set[str] = frozenset()) -> tuple[dict, dict]:
    """`<prefix><flattened path>.lora_down.weight / .lora_up.weight / .alpha` with the module's real alpha."""
    components = {m.component for m in modules} | set(base_components)
    tensors: dict[str, torch.Tensor] = {}
    for m in modules:
        name = m.name
        if not m.flat and (m.component or "").startswith("text_encoder") and KOHYA_TEXT_MODEL.match(name):
            name = "text_model." + name
        name = name if m.flat else flatten(name)
        stem = (m.prefix or kohya_prefix(m.component, components)) + name
        if f"{stem}.lora_down.weight" in tensors:
            raise BadInputError(f"two modules flatten to the same kohya name {stem}", tensor=stem)
        tensors[f"{stem}.lora_down.weight"] = m.down
        tensors[f"{stem}.lora_up.weight"] = m.up
        tensors[f"{stem}.alpha"] = torch.tensor(m.alpha, dtype=torch.float32)
        if m.magnitude is not None:  # LyCORIS dora_scale, output axis (out, 1, ..) as wd_on_out writes it (§3)
            tensors[f"{stem}.dora_scale"] = m.magnitude.reshape(-1, *([1] * (m.down.dim() - 1))).contiguous()
    meta = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(_most_common([m.rank for m in modules])),
        "ss_network_alpha": str(_most_common([m.alpha for m in modules])),
        "converter_alphas": "per module, in each .alpha tensor (scale = alpha / rank)",
        "converter": json.dumps(info, sort_keys=True),
    }
    return tensors, meta


DENOISERS = ("denoiser", "unet", "transformer")


def folded_up(m: LoraModule) -> torch.Tensor:
    """lora_B with the module's scale alpha / rank folded in, for files that carry no alpha (ComfyUI and diffusers
    then use scale 1, ai-toolkit's form). A power of two scales exactly in the stored dtype; any other scale is
    applied in float32 (one rounding of each product, which the read-back proof allows)."""
    scale = m.alpha / m.rank
    if scale == 1.0:
        return m.up
    mantissa, _ = math.frexp(scale)
    if mantissa == 0.5:
        scaled = m.up * scale
        if torch.isfinite(scaled).all() and torch.equal(scaled / scale, m.up):
            return scaled
    return m.up.float() * scale


# The prefix a file of each spelling kind puts before a dotted denoiser name (docs/FORMATS.md §12).
DOTTED_PREFIX = {"comfyui": "diffusion_model.", "peft": "base_model.model.", "diffusers": "transformer.", "bare": ""}


def comfyui_tensors(
    modules: list[LoraModule], info: dict, base_components: set[str] = frozenset(), prefix: str = "diffusion_model."
) -> tuple[dict, dict]:
    """`<prefix><module>.lora_A.weight / .lora_B.weight` for the denoiser (`diffusion_model.` + the key of ComfyUI's
    own model, which every ComfyUI version looks up, docs/FORMATS.md §5; a family's keymap may name another prefix
    ComfyUI reads for it), kohya's names for text encoders; no alpha tensors, the scale folded into lora_B:
    diffusers' converters for the newer families refuse leftover alphas (§12)."""
    tensors: dict[str, torch.Tensor] = {}
    rest = []
    for m in modules:
        if m.component not in DENOISERS:
            rest.append(m)
            continue
        if m.flat:
            raise BadInputError(
                f"{m.source}: a kohya-flattened name cannot be written with dots without the model; give --base",
                tensor=m.source,
            )
        if m.magnitude is not None:
            raise BadInputError(
                f"{m.source}: DoRA has no ComfyUI diffusion_model. form here; convert to kohya", tensor=m.source
            )
        stem = f"{prefix}{m.name}"
        if f"{stem}.lora_A.weight" in tensors:
            raise BadInputError(f"two modules are written as {stem}", tensor=stem)
        tensors[f"{stem}.lora_A.weight"] = m.down
        tensors[f"{stem}.lora_B.weight"] = folded_up(m)
    meta = {"converter_alphas": "folded into lora_B (no .alpha tensors; scale 1 when loaded)",
            "converter": json.dumps(info, sort_keys=True)}  # fmt: skip
    if rest:
        te, _ = kohya_tensors(rest, info, base_components | {m.component for m in modules})
        tensors.update(te)
    return tensors, meta


def lora_config(modules: list[LoraModule]) -> dict:
    """PEFT LoraConfig fields for these modules: the most common rank and alpha, the others as patterns (full
    module paths; PEFT matches `(.*\\.)?(key)$`, §7)."""
    r = _most_common([m.rank for m in modules])
    alpha = _most_common([m.alpha for m in modules])
    rank_pattern = {m.name: m.rank for m in modules if m.rank != r}
    alpha_pattern = {m.name: m.alpha for m in modules if m.alpha != alpha}
    alpha = int(alpha) if float(alpha).is_integer() else alpha
    dora = {m.magnitude is not None for m in modules}
    if len(dora) > 1:
        raise BadInputError(
            "some modules are DoRA and some are not; PEFT's use_dora applies to every module, so this mix has no "
            "PEFT/diffusers form (convert to kohya instead)"
        )
    return {
        "r": r,
        "lora_alpha": alpha,
        "rank_pattern": rank_pattern,
        "alpha_pattern": {k: int(v) if float(v).is_integer() else v for k, v in alpha_pattern.items()},
        "target_modules": sorted(m.name for m in modules),
        "use_rslora": False,
        "use_dora": dora == {True},
        "lora_bias": False,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
    }


def peft_magnitude(m: LoraModule) -> torch.Tensor:
    """PEFT's layout of a DoRA magnitude: (out,) for a linear layer, (1, out, 1, 1) for a conv (§7)."""
    if m.down.dim() > 2:
        return m.magnitude.reshape(1, -1, *([1] * (m.down.dim() - 2))).contiguous()
    return m.magnitude.contiguous()


def write_peft(modules: list[LoraModule], folder: Path, info: dict, base_model: str | None) -> list[str]:
    """A PEFT folder per component (the folder itself when there is one): adapter_config.json + weights."""
    from safetensors.torch import save_file

    groups: dict[str | None, list[LoraModule]] = {}
    for m in modules:
        groups.setdefault(m.component, []).append(m)
    files = []
    for comp, mods in sorted(groups.items(), key=lambda g: str(g[0])):
        sub = folder if len(groups) == 1 else folder / str(comp)
        sub.mkdir(parents=True, exist_ok=True)
        config = {
            "peft_type": "LORA",
            "task_type": None,
            "base_model_name_or_path": base_model,
            "inference_mode": True,
            **lora_config(mods),
            "modules_to_save": None,
        }
        (sub / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = {}
        for m in mods:
            tensors[f"base_model.model.{m.name}.lora_A.weight"] = m.down.contiguous()
            tensors[f"base_model.model.{m.name}.lora_B.weight"] = m.up.contiguous()
            if m.magnitude is not None:
                # the key PEFT 0.21 itself saves (no `.weight`; its loader takes both, §7)
                tensors[f"base_model.model.{m.name}.lora_magnitude_vector"] = peft_magnitude(m)
        meta = {"format": "pt", "converter_alphas": "rank_pattern / alpha_pattern in adapter_config.json (not folded)",
                "converter": json.dumps(info, sort_keys=True)}  # fmt: skip
        save_file(tensors, sub / "adapter_model.safetensors", metadata=meta)
        prefix = "" if sub == folder else f"{comp}/"
        files += [f"{prefix}adapter_config.json", f"{prefix}adapter_model.safetensors"]
    return files


def write_diffusers(modules: list[LoraModule], folder: Path, info: dict, base_model: str | None = None) -> list[str]:
    """diffusers' own layout (what `save_lora_weights` writes): `<component>.<module>.lora_A/B.weight` and the
    LoraConfig of each component in `lora_adapter_metadata`, with per-module rank/alpha patterns (§4)."""
    from safetensors.torch import save_file

    groups: dict[str, list[LoraModule]] = {}
    for m in modules:
        if m.component is None:
            raise UsageError(
                "diffusers LoRA keys start with the pipeline component (unet., transformer., text_encoder.): "
                "pass --component to say which one this adapter is for"
            )
        if m.component == "denoiser":
            raise BadInputError(
                f"{m.source}: these are the original model's module names (LDM/BFL/...), not diffusers': give --base "
                "as a diffusers pipeline folder so they are looked up under diffusers' names",
                tensor=m.source,
            )
        groups.setdefault(m.component, []).append(m)
    tensors, packed = {}, {}
    for comp, mods in groups.items():
        for m in mods:
            tensors[f"{comp}.{m.name}.lora_A.weight"] = m.down.contiguous()
            tensors[f"{comp}.{m.name}.lora_B.weight"] = m.up.contiguous()
            if m.magnitude is not None:
                tensors[f"{comp}.{m.name}.lora_magnitude_vector"] = peft_magnitude(m)
        packed.update({f"{comp}.{k}": v for k, v in lora_config(mods).items()})
    meta = {
        "format": "pt",
        "lora_adapter_metadata": json.dumps(packed, sort_keys=True),
        "converter_alphas": "rank_pattern / alpha_pattern in lora_adapter_metadata (not folded)",
        "converter": json.dumps(info, sort_keys=True),
    }
    save_file(tensors, folder / DIFFUSERS_FILE, metadata=meta)
    return [DIFFUSERS_FILE]
