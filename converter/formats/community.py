"""Community adapter files (one .safetensors, no adapter_config.json): kohya sd-scripts / musubi LoRA and LoCon,
LyCORIS (LoHa, LoKr, full, DoRA), OneTrainer, SimpleTuner `lycoris_`, diffusers (PEFT-style and older layouts),
ComfyUI / ai-toolkit `diffusion_model.`, xlabs Flux.

Facts from each writer's own source: docs/FORMATS.md (sections cited below). Names are kept as the
file spells them; where they are flattened with '_' (kohya), `flat` is set and the resolver looks them up among
the base's keys flattened the same way, never by guessing where the dots were.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import defaultdict
from pathlib import Path

from converter.errors import AdapterFormatError
from converter.formats.adapter import Adapter, AdapterPatch, SafetensorsSource, open_tensor_file
from converter.formats.patches import BiasDelta, DeltaPatch, DoRA, FullDelta, LoHa, LoKr, LowRank, Ref
from converter.formats.peft import pattern_value
from converter.io.lazy import torch

NAME = "community"

# File-level tensor suffix -> role, longest first when matching.
SUFFIXES = {
    # kohya / LyCORIS LoCon (§1, §3)
    ".lora_down.weight": "down",
    ".lora_up.weight": "up",
    ".lora_mid.weight": "mid",
    ".alpha": "alpha",
    ".dora_scale": "dora",
    # LyCORIS LoHa, LoKr, full (§3)
    ".hada_w1_a": "hada_w1_a",
    ".hada_w1_b": "hada_w1_b",
    ".hada_w2_a": "hada_w2_a",
    ".hada_w2_b": "hada_w2_b",
    ".hada_t1": "hada_t1",
    ".hada_t2": "hada_t2",
    ".lokr_w1": "lokr_w1",
    ".lokr_w1_a": "lokr_w1_a",
    ".lokr_w1_b": "lokr_w1_b",
    ".lokr_w2": "lokr_w2",
    ".lokr_w2_a": "lokr_w2_a",
    ".lokr_w2_b": "lokr_w2_b",
    ".lokr_t2": "lokr_t2",
    ".diff": "diff",
    ".diff_b": "diff_b",
    # diffusers / PEFT-style (§4, §7), ComfyUI probes (§5)
    ".lora_A.weight": "down",
    ".lora_B.weight": "up",
    ".lora_A.default.weight": "down",
    ".lora_B.default.weight": "up",
    ".lora_B.bias": "up_bias",
    ".lora_magnitude_vector.weight": "magnitude",
    ".lora_magnitude_vector": "magnitude",
    ".magnitude": "magnitude",  # ai-toolkit's DoRA (PEFT's magnitude, one per output row)
    # older diffusers layouts (§4): `.lora.down`, attn-processor `to_q_lora.down`, `lora_linear_layer.down`
    ".lora.down.weight": "down",
    ".lora.up.weight": "up",
    "_lora.down.weight": "down",
    "_lora.up.weight": "up",
    ".lora_linear_layer.down.weight": "down",
    ".lora_linear_layer.up.weight": "up",
    # xlabs Flux `processor.qkv_lora1.down.weight` (§10)
    ".down.weight": "down",
    ".up.weight": "up",
}
_ORDERED = sorted(SUFFIXES, key=len, reverse=True)
# LyCORIS algorithms we recognise but cannot merge yet: a clear refusal beats a silent skip.
UNSUPPORTED = {
    ".on_input": "(IA)^3",
    ".oft_blocks": "OFT/BOFT",
    ".w_norm": "Norm",
    ".b_norm": "Norm",
    ".a1.weight": "GLoRA",
}

# Flattened prefixes (kohya-style names): prefix -> component. lora_te3 is T5 in kohya Flux/SD3 (§1); the keymap
# says which base component each adapter component lands on (OneTrainer/LyCORIS put T5 at lora_te2, §3, §6).
FLAT_PREFIXES = {
    "lora_unet_": "denoiser",
    "lora_transformer_": "denoiser",  # OneTrainer
    "lycoris_": "denoiser",  # LyCORIS wrapper (SimpleTuner)
    "lora_te1_": "text_encoder",
    "lora_te2_": "text_encoder_2",
    "lora_te3_": "text_encoder_3",
    "lora_te_": "text_encoder",
}
# Dotted prefixes (diffusers, ComfyUI, PEFT without a config) -> component.
DOTTED_PREFIXES = {
    "unet.": "denoiser",
    "transformer.": "denoiser",
    "diffusion_model.": "denoiser",  # ComfyUI / ai-toolkit / musubi converted
    "base_model.model.": "denoiser",
    "base_model.model.transformer.": "denoiser",  # PEFT over a wrapper that holds the model as `transformer`
    "text_encoder.": "text_encoder",
    "text_encoder_2.": "text_encoder_2",
    "text_encoder_3.": "text_encoder_3",
    "text_encoders.clip_l.transformer.": "text_encoder",  # ComfyUI-saved
}
ROLE_LABEL = {"down": "lora_down/lora_A", "up": "lora_up/lora_B"}


def _weights_file(path: Path) -> Path | None:
    if path.is_file():
        return path if path.suffix == ".safetensors" else None
    if path.is_dir() and not (path / "adapter_config.json").exists():
        files = sorted(path.glob("*.safetensors"))
        if len(files) == 1:
            return files[0]
        for name in ("pytorch_lora_weights.safetensors",):
            if (path / name).is_file():
                return path / name
    return None


def _split_suffix(key: str) -> tuple[str, str] | None:
    for suffix in _ORDERED:
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)], SUFFIXES[suffix]
    return None


def detect(path: Path) -> bool:
    f = _weights_file(path)
    if f is None:
        return False
    names = list(SafetensorsSource(f).file.tensors)
    known = sum(_split_suffix(n) is not None or n.endswith(tuple(UNSUPPORTED)) for n in names)
    return bool(names) and known * 2 > len(names)


def _name(stem: str, where: Path, processor: bool = False) -> tuple[str | None, str, bool]:
    """(component, module name, flat) of a module stem; `processor`: its tensors are old diffusers attention-processor
    ones (`to_out_lora.down`), whose `to_out` is the module `to_out.0`."""
    if stem.startswith("lora_unet__"):  # Wan-Fun files (ComfyUI lora_convert)
        stem = "lora_unet_" + stem[len("lora_unet__") :]
    for prefixes, flat in ((FLAT_PREFIXES, True), (DOTTED_PREFIXES, False)):
        for prefix, component in sorted(prefixes.items(), key=lambda p: -len(p[0])):
            if stem.startswith(prefix):
                rest = stem[len(prefix) :]
                if any(rest.startswith(p) for p in (*FLAT_PREFIXES, *DOTTED_PREFIXES)):
                    raise AdapterFormatError(
                        f"{where}: tensor names start with a doubled prefix ({stem.split('.')[0][:60]}...): "
                        "the file was converted twice; strip one prefix and retry",
                        file=where,
                    )
                return component, _normalise(rest, component, processor), flat
    return "denoiser", _normalise(stem, "denoiser", processor), False  # bare diffusers/xlabs/DiffSynth names


# Older diffusers layouts and xlabs processors, as module-path rewrites (§4 UNET_TO_DIFFUSERS, §10 xlabs).
_REWRITES = [
    (".processor.to_q", ".to_q"),
    (".processor.to_k", ".to_k"),
    (".processor.to_v", ".to_v"),
    (".processor.to_out", ".to_out.0"),
    (".processor.qkv_lora1", ".img_attn.qkv"),
    (".processor.qkv_lora2", ".txt_attn.qkv"),
    (".processor.proj_lora1", ".img_attn.proj"),
    (".processor.proj_lora2", ".txt_attn.proj"),
    (".processor.qkv_lora", ".linear1_qkv"),
]
_TE_REWRITES = [(".to_q", ".q_proj"), (".to_k", ".k_proj"), (".to_v", ".v_proj"), (".to_out", ".out_proj")]


def _normalise(module: str, component: str, processor: bool = False) -> str:
    for old, new in _REWRITES:
        if module.endswith(old):
            module = module[: -len(old)] + new
    if component.startswith("text_encoder"):
        for old, new in _TE_REWRITES:
            if module.endswith(old):
                module = module[: -len(old)] + new
    if module.endswith(".to_out") and component == "denoiser" and processor:
        module += ".0"
    return module


def _alpha(tensors, roles: dict[str, str]) -> float | None:
    if "alpha" not in roles:
        return None
    t = tensors.read(roles["alpha"])
    if t.numel() != 1:
        raise AdapterFormatError(
            f"{tensors.path}: {roles['alpha']}: alpha must be a single number, found shape {list(t.shape)}",
            file=tensors.path,
            tensor=roles["alpha"],
        )
    return float(t.reshape(()).item())


def _scale(alpha: float | None, rank: int) -> float:
    """kohya/LyCORIS: alpha None or 0 means alpha = rank, scale = alpha / rank (§1, §3)."""
    return 1.0 if alpha in (None, 0.0) else alpha / rank


def _diffusers_alphas(metadata: dict[str, str], where: Path) -> dict:
    """`lora_adapter_metadata` (§4): LoraConfig fields, prefixed per component when saved by a pipeline."""
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return {}
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError:
        meta = None
    if not isinstance(meta, dict):
        raise AdapterFormatError(
            f"{where}: lora_adapter_metadata in the file's header is not a JSON object of LoraConfig fields; "
            "remove it or fix it",
            file=where,
        )
    return meta


def _config_scale(meta: dict, component_prefix: str | None, module: str, rank: int, where: Path) -> float | None:
    """Scale from diffusers' saved LoraConfig (lora_alpha / r, rank/alpha patterns, rsLoRA), or None."""

    def get(field, default=None):
        if component_prefix and f"{component_prefix}.{field}" in meta:
            return meta[f"{component_prefix}.{field}"]
        return meta.get(field, default)

    alpha = get("lora_alpha")
    if alpha is None:
        return None
    alpha = pattern_value(get("alpha_pattern") or {}, module, alpha, where)
    if not _is_number(alpha):
        raise AdapterFormatError(
            f"{where}: lora_adapter_metadata gives lora_alpha {alpha!r} for {module}; it must be a number", file=where
        )
    return alpha / math.sqrt(rank) if get("use_rslora") else alpha / rank


def _ref(tensors, roles, role) -> Ref | None:
    return Ref(tensors, roles[role]) if role in roles else None


def _need(roles: dict[str, str], wanted: tuple[str, ...], stem: str, where: Path) -> None:
    missing = [r for r in wanted if r not in roles]
    if missing:
        have = ", ".join(sorted(roles))
        raise AdapterFormatError(
            f"{where}: module {stem} has {have} but no {', '.join(ROLE_LABEL.get(m, m) for m in missing)} "
            "(incomplete or damaged file)",
            file=where,
            tensor=next(iter(roles.values()), None),
        )


def _loha(tensors, roles, stem, where) -> DeltaPatch:
    _need(roles, ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"), stem, where)
    r = {k: Ref(tensors, v) for k, v in roles.items() if k.startswith("hada_")}
    rank = r["hada_w1_b"].shape[0]
    alpha = _alpha(tensors, roles)
    if "hada_t1" in r and "hada_t2" in r:  # Tucker: w*_a (r, out), w*_b (r, in), t (r, r, *k)
        shape = (r["hada_w1_a"].shape[1], r["hada_w1_b"].shape[1], *r["hada_t1"].shape[2:])
    else:
        shape = (r["hada_w1_a"].shape[0], math.prod(r["hada_w1_b"].shape[1:]))
    return LoHa(
        r["hada_w1_a"], r["hada_w1_b"], r["hada_w2_a"], r["hada_w2_b"], _scale(alpha, rank), shape,
        r.get("hada_t1"), r.get("hada_t2"), alpha,
    )  # fmt: skip


def _lokr(tensors, roles, stem, where) -> DeltaPatch:
    r = {k: Ref(tensors, v) for k, v in roles.items() if k.startswith("lokr_")}
    factors = []
    rank = None
    for i in ("1", "2"):
        if f"lokr_w{i}" in r:
            factors.append(r[f"lokr_w{i}"])
        elif f"lokr_w{i}_a" in r and f"lokr_w{i}_b" in r:
            factors.append((r[f"lokr_w{i}_a"], r[f"lokr_w{i}_b"]))
            rank = r[f"lokr_w{i}_b"].shape[0]  # ComfyUI: dim = w_b.shape[0], the last one wins (§6)
        else:
            _need(roles, (f"lokr_w{i}",), stem, where)
    w1, w2 = factors
    alpha = _alpha(tensors, roles)
    # LyCORIS: both factors full -> alpha forced to rank, scale 1; else alpha / rank (§3 LoKr).
    scale = 1.0 if rank is None else _scale(alpha, rank)
    rows1, cols1 = (w1.shape if isinstance(w1, Ref) else (w1[0].shape[0], w1[1].shape[1]))[:2]
    t2 = r.get("lokr_t2")
    if isinstance(w2, Ref):
        shape = (rows1 * w2.shape[0], cols1 * w2.shape[1], *w2.shape[2:])
    elif t2 is not None:  # Tucker: w2_a (r, out_k), w2_b (r, in_n), t2 (r, r, *k)
        shape = (rows1 * w2[0].shape[1], cols1 * w2[1].shape[1], *t2.shape[2:])
    else:
        shape = (rows1 * w2[0].shape[0], cols1 * math.prod(w2[1].shape[1:]))
    return LoKr(w1, w2, scale, tuple(shape), t2, alpha)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _peft_style(weights: Path, stems) -> bool:
    """PEFT's own save (its file name, or its `base_model.model.` prefix): its alpha lives in adapter_config.json."""
    return weights.name == "adapter_model.safetensors" or any(s.startswith("base_model.model.") for s in stems)


def parse(
    path: Path, *, allow_pickle: bool = False, lora_alpha: float | None = None, require_scale: bool = True
) -> Adapter:
    weights = _weights_file(path)
    if weights is None:
        raise AdapterFormatError(f"{path}: not a single .safetensors adapter file", file=path)
    tensors = open_tensor_file(weights, allow_pickle)
    reading = _Reading(
        tensors,
        weights,
        meta=_diffusers_alphas(tensors.metadata, weights),
        # our own ComfyUI-style files carry their scale in lora_B (convert --to comfyui): scale 1 is the file's word
        folded=tensors.metadata.get("converter_alphas", "").startswith("folded into lora_B"),
        lora_alpha=lora_alpha,
    )
    groups = _group_modules(tensors, weights)
    for stem, roles in groups.items():
        _read_module(reading, stem, roles)
    summary = _summary(reading)
    warnings = _scale_checks(reading, summary, _peft_style(weights, groups), require_scale)
    if reading.split_qkv:
        summary["split_qkv_modules"] = len(reading.split_qkv)
        warnings.append(
            f"{weights}: {len(reading.split_qkv)} fused modules (e.g. {reading.split_qkv[0]}) look like kohya's "
            "split_qkv layout (block-diagonal lora_up); merged with alpha / lora_down rows like every loader does, "
            "which is 1/3 (1/4 for linear1) of the scale used in training (sd-scripts issue 2204)"
        )
    md = tensors.metadata
    # kohya records the base checkpoint's file name it trained on; a family tag alone is no base model
    base_model = md.get("ss_sd_model_name")
    return Adapter(
        path=path,
        format=summary["flavour"],
        tensors=tensors,
        patches=reading.patches,
        config={"metadata": dict(md)},
        base_model=None if base_model is None else str(base_model),
        summary={k: v for k, v in summary.items() if v not in (None, [], {})},
        files=[weights],
        warnings=warnings,
    )


@dataclasses.dataclass
class _Reading:
    """One file as its modules are read: what every module's handler needs, and what the summary and the
    warnings count over all modules."""

    tensors: object
    weights: Path
    meta: dict  # lora_adapter_metadata (diffusers' saved LoraConfig), {} when none
    folded: bool  # scales already folded into lora_B: no alpha means scale 1, said by the file itself
    lora_alpha: float | None  # the user's word for PEFT-style files without alphas
    patches: list[AdapterPatch] = dataclasses.field(default_factory=list)
    split_qkv: list[str] = dataclasses.field(default_factory=list)
    no_alpha: int = 0  # lora_A/lora_B modules whose scale nothing states
    stated: int = 0  # modules scaled by the user's lora_alpha
    flavours: set[str] = dataclasses.field(default_factory=set)
    ranks: set[int] = dataclasses.field(default_factory=set)
    alphas: set[float] = dataclasses.field(default_factory=set)
    components: set[str] = dataclasses.field(default_factory=set)


def _group_modules(tensors, weights: Path) -> dict[str, dict[str, str]]:
    """Every tensor name split into (module stem, role): {stem: {role: tensor name}}. A tensor that is no part of a
    format we can merge is refused here, by name, before anything is read."""
    groups: dict[str, dict[str, str]] = defaultdict(dict)
    for key in tensors.names():
        _refuse_unmergeable(key, weights)
        split = _split_suffix(key)
        if split is None:
            raise AdapterFormatError(
                f"{weights}: tensor {key} is not part of any adapter format converter knows "
                "(expected lora_down/lora_up/alpha, lora_A/lora_B, hada_*, lokr_*, diff, dora_scale ...)",
                file=weights,
                tensor=key,
            )
        stem, role = split
        if role in groups[stem]:
            raise AdapterFormatError(
                f"{weights}: module {stem} has two {role} tensors ({groups[stem][role]}, {key})",
                file=weights,
                tensor=key,
            )
        groups[stem][role] = key
    return groups


def _refuse_unmergeable(key: str, weights: Path) -> None:
    """Tensors of adapters we recognise but cannot merge: a clear refusal beats a silent skip."""
    if key.endswith(("query_norm.scale", "key_norm.scale")):  # BFL's control LoRAs (docs/FORMATS.md §12)
        raise AdapterFormatError(
            f"{weights}: {key} is a norm scale: this is a FLUX control LoRA (BFL's Canny/Depth), which replaces "
            "norm weights and widens img_in to take the control image, making a FLUX.1-Canny/Depth-dev model; "
            "merging it is not supported (load it with diffusers' FluxControlPipeline)",
            file=weights,
            tensor=key,
        )
    for suffix, algo in UNSUPPORTED.items():
        if key.endswith(suffix):
            raise AdapterFormatError(
                f"{weights}: {key} is a LyCORIS {algo} tensor; {algo} cannot be merged yet",
                file=weights,
                tensor=key,
            )


def _read_module(reading: _Reading, stem: str, roles: dict[str, str]) -> None:
    """One module's tensors -> its weight patch (the handler of its first role in _DELTA_BY_ROLE) and bias
    patches, each checked on shapes now rather than failing in the middle of a merge."""
    tensors, weights = reading.tensors, reading.weights
    _check_factor_shapes(tensors, roles, weights)
    processor = any(k.endswith(("_lora.down.weight", "_lora.up.weight")) for k in roles.values())
    component, module, flat = _name(stem, weights, processor)
    reading.components.add(component or "?")
    reading.flavours.add(_flavour(stem, roles))
    handler = next((h for role, h in _DELTA_BY_ROLE.items() if role in roles), None)
    delta = None if handler is None else handler(reading, stem, roles, module, flat)
    if delta is None and "diff_b" not in roles:
        raise AdapterFormatError(
            f"{weights}: module {stem} has only {', '.join(sorted(roles))} and no weights to merge "
            "(an alpha or dora_scale without its lora_down/lora_up? incomplete file)",
            file=weights,
            tensor=next(iter(roles.values())),
        )

    def add(param: str, patch) -> None:
        reading.patches.append(AdapterPatch(module, param, patch, component=component, flat=flat, native=stem))

    if delta is not None:
        _check_delta(delta, tensors, weights, stem)
        add("weight", _with_magnitude(delta, tensors, roles))
    for role, bias in _BIAS_BY_ROLE.items():
        if role in roles and (patch := bias(Ref(tensors, roles[role]), delta)) is not None:
            add("bias", patch)


def _with_magnitude(delta: DeltaPatch, tensors, roles: dict[str, str]):
    """DoRA: the delta under a magnitude, LyCORIS' dora_scale or PEFT's (ai-toolkit's) magnitude vector."""
    for role, style in _DORA_STYLE.items():
        if role in roles:
            return DoRA(delta, Ref(tensors, roles[role]), style=style)
    return delta


def _lowrank_delta(reading: _Reading, stem: str, roles: dict[str, str], module: str, flat: bool) -> DeltaPatch:
    """kohya/LoCon lora_down/lora_up (lora_mid: Tucker), diffusers/PEFT-style lora_A/lora_B."""
    tensors, weights = reading.tensors, reading.weights
    _need(roles, ("down", "up"), stem, weights)
    down, up = Ref(tensors, roles["down"]), Ref(tensors, roles["up"])
    mid = _ref(tensors, roles, "mid")
    rank = down.shape[0]
    if up.shape[1] != rank or (mid is None and len(down.shape) != len(up.shape)):
        raise AdapterFormatError(
            f"{weights}: {roles['up']} has shape {list(up.shape)} but {roles['down']} has "
            f"{list(down.shape)}: their ranks (up dim 1, down dim 0) must agree",
            file=weights,
            tensor=roles["up"],
        )
    alpha, scale = _lowrank_scale(reading, stem, roles, module, flat, rank)
    reading.ranks.add(rank)
    if alpha is not None:
        reading.alphas.add(alpha)
    delta = LowRank(down, up, scale, mid=mid, alpha=alpha)
    if flat and _split_qkv(module, tensors, roles, rank):
        reading.split_qkv.append(stem)
    return delta


def _lowrank_scale(
    reading: _Reading, stem: str, roles: dict[str, str], module: str, flat: bool, rank: int
) -> tuple[float | None, float]:
    """(alpha, scale) of a low-rank module: its .alpha tensor, else lora_adapter_metadata, else (lora_A/lora_B
    files) the user's lora_alpha, else scale 1 and counted in `no_alpha` for the warning or refusal."""
    alpha = _alpha(reading.tensors, roles)
    scale = _scale(alpha, rank)
    if alpha is None and reading.meta:
        prefix = stem.split(".", 1)[0] if not flat else None
        scale = _config_scale(reading.meta, prefix, module, rank, reading.weights) or scale
    elif alpha is None and not reading.folded and roles["down"].endswith(("lora_A.weight", "lora_A.default.weight")):
        if reading.lora_alpha is None:
            reading.no_alpha += 1
        else:  # the user's word: lora_alpha over the factors' own rank (PEFT's rule without rsLoRA)
            alpha, scale = float(reading.lora_alpha), float(reading.lora_alpha) / rank
            reading.stated += 1
    return alpha, scale


def _loha_delta(reading: _Reading, stem: str, roles: dict[str, str], module: str, flat: bool) -> DeltaPatch:
    """LyCORIS LoHa (hada_*)."""
    delta = _loha(reading.tensors, roles, stem, reading.weights)
    reading.ranks.add(delta.rank)
    return delta


def _lokr_delta(reading: _Reading, stem: str, roles: dict[str, str], module: str, flat: bool) -> DeltaPatch:
    """LyCORIS LoKr (lokr_*)."""
    return _lokr(reading.tensors, roles, stem, reading.weights)


def _full_delta(reading: _Reading, stem: str, roles: dict[str, str], module: str, flat: bool) -> DeltaPatch:
    """LyCORIS full: the delta itself (diff)."""
    return FullDelta(Ref(reading.tensors, roles["diff"]))


# Key role -> the handler that builds its module's weight delta. A module's first role in this order decides (one
# with lora_down/lora_up is a LoRA whatever else it holds); a module with none of them has no weight delta.
_DELTA_BY_ROLE = {
    "down": _lowrank_delta,
    "up": _lowrank_delta,
    "hada_w1_a": _loha_delta,
    "hada_w1_b": _loha_delta,
    **{role: _lokr_delta for role in SUFFIXES.values() if role.startswith("lokr_")},
    "diff": _full_delta,
}
# Key role -> the DoRA style of the magnitude it holds (the first present wins).
_DORA_STYLE = {"dora": "lycoris", "magnitude": "peft"}
# Key role -> its bias patch, given the module's weight delta (None: no bias patch).
_BIAS_BY_ROLE = {
    "up_bias": lambda ref, delta: BiasDelta(ref, delta.scale) if isinstance(delta, LowRank) else None,
    "diff_b": lambda ref, delta: BiasDelta(ref, 1.0),
}


def _summary(reading: _Reading) -> dict:
    """What `inspect` shows and the provenance records about the file: writers, ranks, alphas, kohya's metadata."""
    md = reading.tensors.metadata
    summary = {
        "flavour": "+".join(sorted(reading.flavours)),
        "ranks": sorted(reading.ranks),
        "alphas": sorted(reading.alphas)[:8],
        "components": sorted(reading.components),
        "network_module": md.get("ss_network_module"),
        "base_model_version": md.get("ss_base_model_version") or md.get("modelspec.architecture"),
        "network_args": md.get("ss_network_args"),
    }
    if reading.meta:
        summary["lora_adapter_metadata"] = True
    return summary


def _scale_checks(reading: _Reading, summary: dict, peft_style: bool, require_scale: bool) -> list[str]:
    """A stated lora_alpha must be needed, and PEFT weights need one (unless only inspected); returns the
    warnings about scales nothing states. Records the user's lora_alpha in `summary`."""
    weights, lora_alpha = reading.weights, reading.lora_alpha
    if lora_alpha is not None and not reading.stated:
        raise AdapterFormatError(
            f"{weights}: every module's scale is already known from the file (.alpha tensors, kohya's alpha = rank "
            "rule, or lora_adapter_metadata); drop lora_alpha for this adapter",
            file=weights,
        )
    if reading.stated:
        summary["lora_alpha"] = float(lora_alpha)
        summary["lora_alpha_from"] = "stated by the user"
    if reading.no_alpha and peft_style and require_scale:
        raise AdapterFormatError(
            f"{weights}: PEFT weights without their adapter_config.json, so lora_alpha (and with it the scale "
            "lora_alpha / r) is unknown; put adapter_config.json beside them, or state it with --lora-alpha N "
            "(recipe: lora_alpha: N per adapter; r is each module's rank)",
            file=weights,
        )
    if reading.no_alpha and peft_style:  # only when require_scale is False (inspect)
        summary["lora_alpha"] = "unknown (no adapter_config.json; merging needs it or --lora-alpha)"
        return [
            f"{weights}: PEFT weights without adapter_config.json: lora_alpha unknown, shown at scale 1; merging "
            "needs adapter_config.json or --lora-alpha"
        ]
    if reading.no_alpha:
        return [
            f"{weights}: {reading.no_alpha} lora_A/lora_B pairs and no alpha anywhere (no .alpha tensors, no "
            "lora_adapter_metadata): merged with scale 1 as diffusers does; if it was trained with lora_alpha != r, "
            "merge its PEFT folder (with adapter_config.json) instead"
        ]
    return []


class _Shapes:
    """A tensor source of empty 'meta' tensors: a patch's math runs on the shapes alone, no data is read."""

    def __init__(self, tensors):
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors.shape(name)

    def read(self, name: str) -> torch.Tensor:
        return torch.empty(self.tensors.shape(name), device="meta")


def _check_delta(delta: DeltaPatch, tensors, where: Path, stem: str) -> None:
    """Factors whose shapes do not fit together (hand-edited or damaged files) are refused now, with the module's
    name, instead of failing in the middle of a merge: the delta is computed on shapes only."""
    meta = _Shapes(tensors)

    def swap(value):
        if isinstance(value, Ref):
            return Ref(meta, value.name)
        return tuple(swap(v) for v in value) if isinstance(value, tuple) else value

    shadow = dataclasses.replace(delta, **{f.name: swap(getattr(delta, f.name)) for f in dataclasses.fields(delta)})
    try:
        numel = shadow.raw_delta().numel()
    except (RuntimeError, ValueError, IndexError) as e:
        numel, why = -1, str(e).splitlines()[0][:120]
    else:
        why = f"their product has {numel} numbers for a {list(delta.natural_shape())} weight"
    if numel != math.prod(delta.natural_shape()):
        shapes = ", ".join(f"{n.rsplit('.', 1)[-1]} {list(tensors.shape(n))}" for n in delta.sources)
        raise AdapterFormatError(
            f"{where}: module {stem}: factor shapes do not fit together ({shapes}: {why}); damaged file?",
            file=where,
            tensor=delta.sources[0],
        )


# Factor matrices (and Tucker cores): at least 2-D with no empty axis, else there is no rank or product to form.
_FACTORS = {"down", "up", "mid", "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2", "lokr_w1",
            "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"}  # fmt: skip


def _check_factor_shapes(tensors, roles: dict[str, str], where: Path) -> None:
    for role, key in roles.items():
        shape = tensors.shape(key)
        if role in _FACTORS and (len(shape) < 2 or 0 in shape):
            raise AdapterFormatError(
                f"{where}: {key} has shape {list(shape)}; a {role} factor must be a matrix with no empty axis "
                "(damaged file?)",
                file=where,
                tensor=key,
            )


def _split_qkv(module: str, tensors, roles: dict[str, str], rank: int) -> bool:
    """kohya lora_flux `split_qkv` saves q/k/v(/mlp) LoRAs fused: down concatenated, up block-diagonal
    (docs/FORMATS.md §1, §8). True when the up matrix has exactly that shape and zeros off its diagonal blocks."""
    n = 3 if module.endswith(("img_attn_qkv", "txt_attn_qkv")) else 4 if module.endswith("linear1") else 0
    if not n or rank % n:
        return False
    up = tensors.read(roles["up"])
    if up.dim() != 2:
        return False
    width = tensors.shape(roles["down"])[1]
    rows = [up.shape[0] // 3] * 3 if n == 3 else [width] * 3 + [up.shape[0] - 3 * width]
    if min(rows) <= 0 or sum(rows) != up.shape[0]:
        return False
    r, start = rank // n, 0
    for j, size in enumerate(rows):
        block = up[start : start + size]
        if torch.count_nonzero(block[:, : j * r]) or torch.count_nonzero(block[:, (j + 1) * r :]):
            return False
        start += size
    return True


def _flavour(stem: str, roles: dict[str, str]) -> str:
    """A short name for what wrote this module, for `inspect` and the provenance record."""
    if any(r.startswith("hada_") for r in roles):
        algo = "loha"
    elif any(r.startswith("lokr_") for r in roles):
        algo = "lokr"
    elif "diff" in roles or "diff_b" in roles:
        algo = "full"
    elif "mid" in roles:
        algo = "locon-tucker"
    else:
        algo = "lora"
    if stem.startswith("lycoris_"):
        writer = "lycoris-wrapper"
    elif stem.startswith("lora_transformer_"):
        writer = "onetrainer"
    elif stem.startswith(tuple(FLAT_PREFIXES)):
        writer = "kohya" if algo == "lora" else "lycoris"
    elif stem.startswith("diffusion_model."):
        writer = "comfyui"
    elif re.search(r"\.processor\.(qkv|proj)_lora\d?$", stem):
        writer = "xlabs"
    else:
        writer = "diffusers"
    return f"{writer}-{algo}"
