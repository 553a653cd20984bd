"""Which diffusion family a community LoRA is for, how it spells its module names, and which tools load it as it is.

Everything here is read from the keymaps (`names`, `shapes`, `loaders`, `targets`): a new family is a keymap file.
A spelling is a prefix kind (kohya `lora_unet_`, OneTrainer `lora_transformer_`, LyCORIS `lycoris_`, ComfyUI /
ai-toolkit `diffusion_model.`, diffusers `transformer.`, PEFT `base_model.model.`, or none) and, for a family
whose original checkpoint and diffusers name modules differently, which of the two names the file uses
(docs/FORMATS.md §12). The module names decide the family; where two families share names (FLUX.1 and FLUX.2
keep BFL's), the keymaps' shape rules (a SwiGLU MLP's width) tell them apart, and where nothing does, every
family that fits is named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from converter.engine.keymap import Keymap, all_keymaps, eval_expr
from converter.formats.adapter import Adapter, AdapterPatch
from converter.formats.patches import LoKr

# The prefix a file writes before a denoiser module's name, and what kind of writer that is (docs/FORMATS.md §12).
PREFIX_KINDS = {
    "lora_unet_": "kohya",
    "lora_transformer_": "onetrainer",
    "lycoris_": "lycoris",
    "diffusion_model.": "comfyui",
    "transformer.": "diffusers",
    "unet.": "diffusers",
    "base_model.model.": "peft",
}
# The tool each target format is for.
TOOL_TARGET = {"diffusers": "diffusers", "comfyui": "comfyui", "kohya": "kohya"}


@dataclass
class Identity:
    """What `inspect` says about a community LoRA's denoiser modules."""

    family: Keymap | None
    candidates: list[str]  # every family whose names and shapes the file fits (several: the names do not tell)
    prefix: str  # kohya, onetrainer, lycoris, comfyui, diffusers, peft, bare
    naming: str | None  # original / diffusers; None for a family that names its modules alike in both
    lokr: bool = False  # a LyCORIS LoKr file: tools read it by the keymap's `lokr_loaders` (none listed: no tool)

    @property
    def spelling(self) -> str:
        return f"{self.prefix}/{self.naming}" if self.naming else self.prefix

    def loads_in(self) -> list[str]:
        """Tools that load the file as it is, by the family keymap's `loaders` (`lokr_loaders` for a LoKr file)."""
        if self.family is None:
            return []
        table = self.family.lokr_loaders if self.lokr else self.family.loaders
        return [tool for tool, spellings in table.items() if self._listed(spellings)]

    def _listed(self, spellings: list[str]) -> bool:
        for s in spellings:
            kind, _, naming = s.partition("/")
            if kind == self.prefix and (not naming or self.naming is None or naming == self.naming):
                return True
        return False


@cache
def _flat(pattern: re.Pattern) -> re.Pattern:
    """The same pattern over kohya-flattened names, where every '.' became '_'."""
    return re.compile(pattern.pattern.replace(r"\.", "[._]"))


def _fits(patterns: list[re.Pattern], module: str, flat: bool) -> bool:
    return any((_flat(p) if flat else p).fullmatch(module) for p in patterns)


def prefix_kind(ap: AdapterPatch, adapter_format: str) -> str:
    native = ap.native or ""
    for prefix, kind in PREFIX_KINDS.items():
        if native.startswith(prefix):
            return kind
    return "peft" if adapter_format.startswith("peft") else "bare"


def _shape(ap: AdapterPatch) -> tuple[int, int] | None:
    try:
        shape = getattr(ap.patch, "lora", ap.patch).natural_shape()  # a DoRA module: its delta's shape
    except (AttributeError, NotImplementedError):
        return None
    return (shape[0], shape[1] if len(shape) > 1 else 1) if shape else None


def naming_of(km: Keymap, modules: list[AdapterPatch]) -> str | None | bool:
    """The naming every module of `modules` has in family `km`; None: the family has one, or these modules are
    named alike in both (LTX's blocks); False: they do not fit the family."""
    if km.one_naming:
        patterns = [p for ps in km.names.values() for p in ps]
        return None if all(_fits(patterns, ap.module, ap.flat) for ap in modules) else False
    fitting = [n for n, patterns in km.names.items() if all(_fits(patterns, ap.module, ap.flat) for ap in modules)]
    return False if not fitting else fitting[0] if len(fitting) == 1 else None


def _shapes_agree(km: Keymap, modules: list[AdapterPatch]) -> bool:
    for pattern, when in km.shapes:
        for ap in modules:
            if not (_flat(pattern) if ap.flat else pattern).fullmatch(ap.module):
                continue
            shape = _shape(ap)
            if shape is not None and not eval_expr(when, {"rows": shape[0], "cols": shape[1]}, {}):
                return False
    return True


def denoiser_patches(adapter: Adapter) -> list[AdapterPatch]:
    return [ap for ap in adapter.patches if ap.component in (None, "denoiser") and ap.param == "weight"]


def identify(adapter: Adapter) -> Identity | None:
    """The family and spelling of a community LoRA's denoiser modules; None when it has none (a text-encoder-only
    or transformers-model adapter)."""
    modules = denoiser_patches(adapter)
    if not modules:
        return None
    kinds = {prefix_kind(ap, adapter.format) for ap in modules}
    lokr = all(isinstance(ap.patch, LoKr) for ap in modules)
    prefix = kinds.pop() if len(kinds) == 1 else "mixed"
    fitting: list[tuple[Keymap, str | None]] = []
    for km in all_keymaps():
        if not km.names:
            continue
        naming = naming_of(km, modules)
        if naming is not False and _shapes_agree(km, modules):
            fitting.append((km, naming))
    if len(fitting) == 1:
        km, naming = fitting[0]
        return Identity(km, [km.name], prefix, naming, lokr)
    namings = {naming for _, naming in fitting}
    naming = namings.pop() if len(namings) == 1 else None
    return Identity(None, [km.name for km, _ in fitting], prefix, naming, lokr)


def convert_hint(identity: Identity, path: str) -> dict[str, str]:
    """For each tool that does not load the file as it is, the `converter convert` command that makes a file it
    loads. `--base` is in the command where names must be looked up (kohya's flattened names, or the other
    naming of a family that has two), and `--rank` for a LoKr file (converted to a LoRA by an SVD)."""
    if identity.family is None:
        return {}
    km, loads = identity.family, set(identity.loads_in())
    flat = identity.prefix in ("kohya", "onetrainer", "lycoris")
    hints = {}
    for tool, target in TOOL_TARGET.items():
        if tool in loads or tool not in km.loaders:  # (a LoKr file converts to a LoRA: the LoRA's loaders)
            continue
        _, wanted = km.target(target)
        needs_base = flat or (identity.naming is not None and wanted is not None and wanted != identity.naming)
        out = f"{_stem(path)}_{target}" + (".safetensors" if target in ("kohya", "comfyui") else "")
        base = " --base BASE" if needs_base else ""
        rank = " --rank RANK" if identity.lokr else ""  # a LoKr has no exact LoRA form: an SVD of a chosen rank
        hints[tool] = f"converter convert --adapter {path} --to {target} --out {out}{base}{rank}"
    return hints


def _stem(path: str) -> str:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return name[: -len(".safetensors")] if name.endswith(".safetensors") else name
