"""Names for the output: an adapter's modules looked up on the base (local, or a Hub base from its headers),
or kept as they are without one (dotted names only: kohya's flattened names cannot be parsed back).
"""

from __future__ import annotations

import copy
from pathlib import Path

from converter.conversion.modules import LoraModule, fuse, lowrank_factors, output_component, split_modules
from converter.engine.base_reader import open_base
from converter.engine.keymap import DiffusionResolver, keymap_for, loaded_name
from converter.errors import BadInputError
from converter.formats import Adapter, AdapterPatch
from converter.formats.patches import ExpertLowRank
from converter.hub.remote_headers import hub_base_headers
from converter.hub.sources import parse_source

# the component of a dotted source prefix (diffusers: `unet` in SD/SDXL, `transformer` in DiTs; ComfyUI's
# `diffusion_model.` keeps the original model's names)
NATIVE_COMPONENT = {"unet.": "unet", "transformer.": "transformer", "diffusion_model.": "denoiser"}


def base_names(spec: str, token: str | None, workdir: Path) -> Path:
    """A base to look names up in. Local: the path itself. Hub: only its configs and safetensors *headers*
    (converter.hub.remote_headers: sparse stand-ins in `workdir`), so a conversion against a 20 GB pipeline downloads
    a few kilobytes. A single file is `org/name[@rev]/file`."""
    source = parse_source(spec)
    if source.local is not None:
        return source.local
    return hub_base_headers(source, token, workdir).path


class BaseNames:
    """The base model's names: a resolver over its real keys, and which component each key belongs to."""

    def __init__(self, path: Path):
        self.denoiser_as: str | None = None  # the component name the denoiser's modules are written under
        self.checkpoint = open_base(path)
        self.keymap = keymap_for(self.checkpoint.config)
        self.resolver = self.checkpoint.make_resolver(self.keymap)
        keys = self.checkpoint.names()
        # single files: the key prefix of each component the file uses (the keymap's `components`)
        self.prefixes: list[tuple[str, str]] = []
        if self.checkpoint.diffusion == "single_file":
            for comp, prefixes in self.keymap.components.items():
                used = next((p for p in prefixes if any(k.startswith(p) for k in keys)), None)
                if used is not None:
                    self.prefixes.append((used, comp))
            self.prefixes.sort(key=lambda p: -len(p[0]))

    @property
    def naming(self) -> str | None:
        """The naming of a diffusion base's denoiser: a diffusers folder has diffusers', a single file the original
        checkpoint's."""
        layout = getattr(self.checkpoint, "diffusion", None)
        return {"diffusers": "diffusers", "single_file": "original"}.get(layout)

    def naming_for(self, to: str) -> BaseNames | RelaidNames:
        """The view whose names target `to` writes: this base, or its denoiser relaid in the family's other naming
        (the keymap's `targets`: kohya and ComfyUI files name FLUX.2's BFL modules, diffusers' its own)."""
        kind, wanted = self.keymap.target(to)
        if kind is None or self.naming is None:
            return self
        view = self if wanted in (None, self.naming) or self.keymap.one_naming else RelaidNames(self, wanted)
        if to == "kohya":  # kohya/musubi files name the denoiser lora_unet_ (not OneTrainer's lora_transformer_)
            view = copy.copy(view)
            view.denoiser_as = "denoiser"
        return view

    def loaded_name(self, component: str | None, name: str) -> str:
        """A module's path in the model transformers loads from the base (or its `component`), where it differs
        from the checkpoint's key (the keymaps' `loaded_without`). The class is the component's config's; a single
        file has none, and its family's keymap names the class diffusers loads the component as."""
        configs = getattr(self.checkpoint, "component_configs", {})
        if component in configs:
            classes = configs[component].get("architectures")
        elif self.checkpoint.diffusion == "single_file":
            classes = self.keymap.diffusers.get(component)
        else:
            classes = self.checkpoint.config.get("architectures")
        return loaded_name(classes, name)

    def components(self) -> set[str]:
        if self.checkpoint.diffusion == "single_file":
            return {c for _, c in self.prefixes}
        return {p.subfolder for p in self.checkpoint.parts if p.subfolder}

    def places(self, ap: AdapterPatch) -> list:
        if hasattr(self.resolver, "resolve_all"):
            return self.resolver.resolve_all(ap.module, ap.param, ap.component, ap.flat)
        place = self.resolver.resolve(ap.module, ap.param, ap.component, ap.flat)
        return [] if place is None else [place]

    def split_key(self, key: str, param: str) -> tuple[str | None, str]:
        """(component, dotted module path) of a base key."""
        module = key[: -len(param) - 1] if key.endswith("." + param) else key
        if "/" in module:  # diffusers folder: <component>/<key>
            comp, module = module.split("/", 1)
            return (self.denoiser_as if comp in ("unet", "transformer") and self.denoiser_as else comp), module
        for prefix, comp in self.prefixes:  # a single file keeps the original names: the denoiser is "denoiser"
            if module.startswith(prefix):
                return (comp if comp.startswith("text_encoder") else "denoiser"), module[len(prefix) :]
        return None, module

    def rows(self, key: str) -> int:
        return self.checkpoint.info(key).shape[0]


def _one_name_each(shapes: dict[str, tuple[int, ...]], dotted: dict[str, set]) -> dict[str, tuple[int, ...]]:
    """Where an alias rule offers alternatives for one tensor (an LDM upsampler sits at index 1 or 2 of its block,
    after an attention or not), the first one (in name order) whose slot no other module occupies: the slot is the
    name up to the part in which the alternatives differ."""
    by_key: dict[str, list[str]] = {}
    for name in shapes:
        places = dotted.get(name, set())
        if len(places) == 1 and (place := next(iter(places))).rows is None and place.src is None:
            by_key.setdefault(place.key, []).append(name)
    drop = set()
    groups = [sorted(n) for n in by_key.values() if len(n) > 1]
    alternatives = {name for names in groups for name in names}
    settled = [name for name in shapes if name not in alternatives]
    for names in groups:
        parts = [name.split(".") for name in names]
        differ = next((i for i in range(min(map(len, parts))) if len({p[i] for p in parts}) > 1), 0)
        slots = {name: ".".join(p[: differ + 1]) + "." for name, p in zip(names, parts, strict=True)}
        free = [n for n in names if not any(o.startswith(slots[n]) for o in settled)]
        drop.update(n for n in names if not free or n != free[0])
    return {k: v for k, v in shapes.items() if k not in drop}


class RelaidNames:
    """A diffusion base's denoiser as the family's other naming would store it, built from the keymap's aliases of
    its real keys: a fused original module (BFL qkv) is the tensors it covers stacked by rows, a diffusers module the
    rows of the fused original it takes. Only names and shapes: nothing is read. Other components are the base's."""

    def __init__(self, base: BaseNames, naming: str):
        self.base, self.naming, self.keymap = base, naming, base.keymap
        self.denoiser_as = "denoiser" if naming == "original" else None
        resolver = base.resolver
        self.component = next(c for c in ("transformer", "unet") if c in resolver.dotted)
        patterns = self.keymap.names.get(naming, [])
        shapes: dict[str, tuple[int, ...]] = {}
        for name, places in resolver.dotted[self.component].items():
            module = name.rsplit(".", 1)[0]
            if not any(p.fullmatch(module) for p in patterns):
                continue
            first = base.checkpoint.info(next(iter(places)).key).shape
            if all(p.src is None and p.rows is None for p in places):
                shapes[name] = first
            elif all(p.src is not None for p in places):
                shapes[name] = (max(p.src[1] for p in places), *first[1:])
            else:  # one row slice of a fused tensor
                place = next(iter(places))
                shapes[name] = (place.rows[1] - place.rows[0], *first[1:])
        shapes = _one_name_each(shapes, resolver.dotted[self.component])
        config = dict(base.checkpoint.component_configs.get(self.component, {})) if hasattr(
            base.checkpoint, "component_configs") else {}  # fmt: skip
        self.resolver = DiffusionResolver(self.keymap, {self.component: ("", {**self.keymap.defaults, **config})},
                                          shapes)  # fmt: skip
        self.shapes = shapes

    def components(self) -> set[str]:
        return self.base.components()

    def loaded_name(self, component: str | None, name: str) -> str:
        return self.base.loaded_name(component, name)

    def places(self, ap: AdapterPatch) -> list:
        if ap.component not in (None, "denoiser", self.component):
            return self.base.places(ap)
        return self.resolver.resolve_all(ap.module, ap.param, ap.component, ap.flat)

    def split_key(self, key: str, param: str) -> tuple[str | None, str]:
        if key not in self.shapes:
            return self.base.split_key(key, param)
        module = key[: -len(param) - 1] if key.endswith("." + param) else key
        return self.denoiser_as or self.component, module

    def rows(self, key: str) -> int:
        return self.shapes[key][0] if key in self.shapes else self.base.rows(key)


def collect(
    adapter: Adapter,
    base: BaseNames | RelaidNames | None,
    to: str,
    *,
    rank: int | None = None,
    component: str | None = None,
) -> tuple[list[LoraModule], dict[str, float]]:
    """The adapter's patches as LoRA modules named for the output (fused/split on the base's layout)."""
    modules: list[LoraModule] = []
    fused: dict[str, list[tuple[tuple[int, int], LoraModule]]] = {}
    svd: dict[str, float] = {}
    for ap in adapter.patches:
        native = ap.native or ap.module
        _check_convertible(adapter, ap, native)
        down, up, alpha, magnitude = lowrank_factors(adapter, ap, rank, svd, native)
        if base is None:
            modules.append(_unresolved(adapter, ap, down, up, alpha, to, component, native))
            modules[-1].magnitude = magnitude
            continue
        places = base.places(ap)
        if not places:
            raise BadInputError(
                f"{adapter.path}: module {native} lands on no tensor of the base (another model family or size?)",
                file=adapter.path,
                tensor=native,
            )
        if magnitude is not None and (len(places) > 1 or places[0].rows is not None):
            raise BadInputError(
                f"{adapter.path}: {native} is DoRA on a fused module that this base splits (or the reverse); a DoRA "
                "norm does not split by rows, so it is not converted",
                file=adapter.path,
                tensor=native,
            )
        if len(places) > 1:  # a fused module onto separate base tensors: split by rows
            names = [base.split_key(p.key, ap.param) for p in places]
            modules.extend(split_modules(names, ap, places, down, up, alpha, native))
            continue
        place = places[0]
        comp, name = base.split_key(place.key, ap.param)
        comp = comp or output_component(ap, component)
        module = LoraModule(comp, name, down, up, alpha, native, magnitude=magnitude)
        if place.rows is not None:  # a slice of a fused base tensor: fused with its siblings below
            fused.setdefault(place.key, []).append((place.rows, module))
        else:
            modules.append(module)
    for key, parts in fused.items():
        if not key.endswith(".weight"):  # OpenCLIP's in_proj_weight: no module of its own to name a LoRA after
            raise BadInputError(
                f"{adapter.path}: {parts[0][1].source} lands on rows of {key}, which has no module name a LoRA "
                "could be written under; give --base in diffusers layout (a pipeline folder) instead",
                file=adapter.path,
                tensor=key,
            )
        modules.append(fuse(key, parts, base.rows(key)))  # type: ignore[union-attr]
    if base is not None and to in ("peft", "diffusers"):
        for m in modules:
            m.name = base.loaded_name(m.component, m.name)
    _check_unique(adapter, modules)
    return modules, svd


def _check_convertible(adapter: Adapter, ap: AdapterPatch, native: str) -> None:
    """Refuse a patch no LoRA file form can hold: one on fused MoE expert tensors, or a bias delta."""
    if isinstance(ap.patch, ExpertLowRank) or ap.either:
        raise BadInputError(
            f"{adapter.path}: {native} is a LoRA on fused MoE expert tensors (PEFT target_parameters); "
            "converting those is not supported (kohya and diffusers have no form for them): merge it instead",
            file=adapter.path,
            tensor=native,
        )
    if ap.param != "weight":
        raise BadInputError(
            f"{adapter.path}: {native} has a bias delta ({ap.patch.sources[0]}); converting bias deltas "
            "is not supported (a LoRA in kohya/PEFT/diffusers form has none)",
            file=adapter.path,
            tensor=native,
        )


def _check_unique(adapter: Adapter, modules: list[LoraModule]) -> None:
    """Refuse two modules that land on one output name (the file would keep only one of them)."""
    seen: dict[tuple, str] = {}
    for m in modules:
        ident = (m.component, m.name)
        if ident in seen:
            raise BadInputError(
                f"{adapter.path}: modules {seen[ident]} and {m.source} both land on {m.name}",
                file=adapter.path,
                tensor=m.name,
            )
        seen[ident] = m.source


def _unresolved(adapter, ap, down, up, alpha, to, component, native) -> LoraModule:
    """Without a base: dotted names are kept as they are; kohya's flattened names can only stay kohya."""
    if ap.flat and to != "kohya":
        raise BadInputError(
            f"{adapter.path}: kohya-style names are flattened ({native}) and cannot be turned back into module "
            "paths without the model: give --base (the model it was trained on) so they are looked up, not guessed",
            file=adapter.path,
            tensor=native,
        )
    comp = component
    if comp is None and ap.component is not None:
        comp = ap.component
        for prefix, name in NATIVE_COMPONENT.items():
            if (ap.native or "").startswith(prefix):
                comp = name
    prefix = native[: len(native) - len(ap.module)] if ap.flat and native.endswith(ap.module) else None
    return LoraModule(comp, ap.module, down, up, alpha, native, flat=ap.flat, prefix=prefix)
