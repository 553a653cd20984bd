"""The math of a conversion: an adapter patch as LoRA factors (as stored, or an SVD), and fused <-> split.

Factors are copied exactly as the file stores them (dtype included); only a fused <-> split change of
layout or an SVD (`--rank`) produces new numbers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from converter.errors import BadInputError
from converter.formats import Adapter, AdapterPatch
from converter.formats.patches import DeltaPatch, DoRA, FullDelta, LoHa, LoKr, LowRank
from converter.formats.peft import pattern_value


@dataclass
class LoraModule:
    """One LoRA module ready to write: ΔW = alpha / rank · up @ down (linear, or conv with down (r, in, *k))."""

    component: str | None  # "unet", "transformer", "text_encoder", ... ; None: a plain transformers model
    name: str  # dotted module path (flattened when `flat`)
    down: torch.Tensor
    up: torch.Tensor
    alpha: float
    source: str  # the module's name in the input file, for messages
    flat: bool = False
    prefix: str | None = None  # a flattened source's own kohya prefix (lora_unet_, lora_transformer_ ...), kept
    magnitude: torch.Tensor | None = None  # DoRA: the per-output-channel magnitude (out,)

    @property
    def rank(self) -> int:
        return self.down.shape[0]


def output_component(ap: AdapterPatch, component: str | None) -> str | None:
    return component or (None if ap.component in (None, "denoiser") and not ap.flat else ap.component)


def _alpha(adapter: Adapter, ap: AdapterPatch, lora: LowRank) -> float:
    """The module's own alpha, such that scale = alpha / rank: the stored one, PEFT's (rank/alpha patterns),
    else scale · rank (diffusers metadata, rsLoRA; no alpha at all means alpha = rank)."""
    r = lora.rank
    if lora.alpha not in (None, 0.0):
        return float(lora.alpha)
    if adapter.format == "peft" and not adapter.config.get("use_rslora"):
        alpha = adapter.config.get("lora_alpha", 8)
        return float(pattern_value(adapter.config.get("alpha_pattern") or {}, ap.module, alpha))
    meta = adapter.config.get("metadata", {}).get("lora_adapter_metadata")
    if meta and not ap.flat:  # diffusers' saved LoraConfig, per component prefix (§4)
        config = json.loads(meta)
        prefix = (ap.native or "").split(".", 1)[0]
        get = lambda f: config.get(f"{prefix}.{f}", config.get(f))  # noqa: E731
        if get("lora_alpha") is not None and not get("use_rslora"):
            return float(pattern_value(get("alpha_pattern") or {}, ap.module, get("lora_alpha")))
    return float(r) if lora.scale == 1.0 else lora.scale * r


def lowrank_factors(adapter: Adapter, ap: AdapterPatch, rank: int | None, svd: dict, native: str):
    """(down, up, alpha, magnitude) of a patch: a LoRA as stored, or an SVD of any other delta when `rank` is
    given; `magnitude` is a DoRA module's per-output-channel magnitude (out,), else None."""
    patch = ap.patch
    if ap.stored_transposed:
        raise BadInputError(
            f"{adapter.path}: {native} is stored transposed (PEFT fan_in_fan_out, GPT-2 Conv1D); kohya and diffusers "
            "LoRAs have no such layout, so it is not converted",
            file=adapter.path,
            tensor=native,
        )
    magnitude = None
    if isinstance(patch, DoRA):
        magnitude = _magnitude(adapter, patch, native)
        patch = patch.lora
        if not (isinstance(patch, LowRank) and patch.mid is None and not patch.flip):
            raise BadInputError(
                f"{adapter.path}: {native} is DoRA on a {type(patch).__name__}; only DoRA on a plain LoRA is converted",
                file=adapter.path,
                tensor=native,
            )
    if isinstance(patch, LowRank) and patch.flip:
        raise BadInputError(
            f"{adapter.path}: {native} is an embedding LoRA (lora_embedding_A/B), which has no kohya/diffusers form",
            file=adapter.path,
            tensor=native,
        )
    if isinstance(patch, LowRank) and patch.mid is None:
        return _raw(patch.down), _raw(patch.up), _alpha(adapter, ap, patch), magnitude
    if not isinstance(patch, DeltaPatch):
        raise BadInputError(
            f"{adapter.path}: {native} is a {type(patch).__name__} patch (a full replacement or token rows, e.g. "
            "PEFT modules_to_save / trainable tokens), not a low-rank delta; it has no LoRA form",
            file=adapter.path,
            tensor=native,
        )
    kind = {LoHa: "LoHa", LoKr: "LoKr", FullDelta: "a full delta", LowRank: "Tucker LoCon"}.get(
        type(patch), type(patch).__name__
    )
    if rank is None:
        raise BadInputError(
            f"{adapter.path}: {native} is {kind}, which has no exact LoRA form; pass --rank N to approximate every "
            "such module by an SVD of rank N (the reconstruction error is reported)",
            file=adapter.path,
            tensor=native,
        )
    down, up, error = svd_lowrank(patch.raw_delta().double(), rank)
    svd[native] = error
    return down, up, float(down.shape[0]), None  # alpha = rank: scale 1, the singular values live in up


def _raw(ref) -> torch.Tensor:
    """A tensor exactly as the file stores it (dtype included): conversion copies, it does not compute."""
    return ref.source.read(ref.name)


def _magnitude(adapter: Adapter, patch: DoRA, native: str) -> torch.Tensor:
    """A DoRA magnitude as PEFT's per-output-channel vector (out,). LyCORIS `dora_scale` (out, 1, ..) is the same
    numbers; the input-axis (1, in, ..) of older LyCORIS/OneTrainer files has no PEFT form (§3 DoRA, LyCORIS#216)."""
    out = patch.lora.natural_shape()[0]
    m = _raw(patch.magnitude)
    if patch.style == "lycoris" and m.dim() >= 2 and m.shape[0] == 1 and out != 1:
        raise BadInputError(
            f"{adapter.path}: {native} has an input-axis dora_scale {list(m.shape)} (older LyCORIS/OneTrainer DoRA); "
            "PEFT/diffusers/current LyCORIS DoRA is per output channel, so it cannot be converted exactly",
            file=adapter.path,
            tensor=native,
        )
    if m.numel() != out:
        raise BadInputError(
            f"{adapter.path}: {native}'s DoRA magnitude has shape {list(m.shape)}, expected {out}",
            file=adapter.path,
            tensor=native,
        )
    return m.reshape(out)


def svd_lowrank(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Best rank-`rank` factors of ΔW (out, in, *k) by SVD of its (out, in·k) matrix, as sd-scripts'
    svd_merge_lora shapes them (§1), without its quantile clamp (it would add error): up = U·S, down = Vh.
    Returns (down, up, relative Frobenius error) with the error measured on the float32 factors."""
    shape = delta.shape
    mat = delta.reshape(shape[0], -1).double()
    r = max(1, min(rank, *mat.shape))
    u, s, vh = torch.linalg.svd(mat, full_matrices=False)
    up = (u[:, :r] * s[:r]).float()
    down = vh[:r].float()
    approx = up.double() @ down.double()
    norm = torch.linalg.norm(mat)
    error = float(torch.linalg.norm(mat - approx) / norm) if norm > 0 else 0.0
    if len(shape) > 2:
        down = down.reshape(r, *shape[1:])
        up = up.reshape(shape[0], r, *([1] * (len(shape) - 2)))
    return down.contiguous(), up.contiguous(), error


def _is_block_diagonal(up: torch.Tensor, rows: list[int]) -> bool:
    """Whether up (out, r) has part j's rows non-zero only in column block j (r / n columns each)."""
    n, r = len(rows), up.shape[1]
    if r % n:
        return False
    width, start = r // n, 0
    for j, size in enumerate(rows):
        block = up[start : start + size].flatten(1)
        if torch.count_nonzero(block[:, : j * width]) or torch.count_nonzero(block[:, (j + 1) * width :]):
            return False
        start += size
    return True


def split_modules(names: list[tuple[str | None, str]], ap, places, down, up, alpha, native) -> list[LoraModule]:
    """A fused module (BFL qkv, linear1) onto separate base tensors, ΔW unchanged: down split with the up when
    the up matrix is block-diagonal (kohya split_qkv), else shared by every part (docs/FORMATS.md §4, §8).
    `names`: each place's (component, module path) on the base, looked up by the caller (conversion.names)."""
    if len({p.key for p in places}) == 1:  # halves swapped on one tensor (BFL [shift, scale] <-> [scale, shift])
        comp, name = names[0]
        moved = torch.empty_like(up)
        for place in places:
            moved[slice(*place.rows)] = up[slice(*place.src)]
        comp = comp or output_component(ap, None)
        return [LoraModule(comp, name, down.clone(), moved, alpha, native)]
    spans = [p.src for p in places]
    rows = [b - a for a, b in spans]
    block = _is_block_diagonal(up, rows)
    n, r = len(spans), down.shape[0]
    out = []
    for j, ((comp, name), (a, b)) in enumerate(zip(names, spans, strict=True)):
        if block:
            w = r // n
            d, u = down[j * w : (j + 1) * w], up[a:b, j * w : (j + 1) * w]
            part_alpha = alpha * w / r  # same scale alpha / r on a rank-w part
        else:
            d, u, part_alpha = down, up[a:b], alpha
        comp = comp or output_component(ap, None)
        out.append(LoraModule(comp, name, d.clone(), u.clone(), part_alpha, f"{native}[{a}:{b}]"))
    return out


def fuse(key: str, parts: list[tuple[tuple[int, int], LoraModule]], total_rows: int) -> LoraModule:
    """Separate modules (to_q/to_k/to_v) onto one fused base tensor (qkv): stacked downs and a block-diagonal up,
    ΔW unchanged. Equal scales stay in alpha; different ones are folded into each part's up block."""
    parts = sorted(parts, key=lambda p: p[0])
    first = parts[0][1]
    scales = {m.alpha / m.rank for _, m in parts}
    if len({tuple(m.down.shape[1:]) for _, m in parts}) != 1:
        raise BadInputError(
            f"modules {', '.join(m.source for _, m in parts)} onto {key} disagree in input shape", tensor=key
        )
    total = sum(m.rank for _, m in parts)
    # different scales are folded into float32 up blocks (folding in half precision would round twice)
    dtype = first.up.dtype if len(scales) == 1 and len({m.up.dtype for _, m in parts}) == 1 else torch.float32
    down = torch.cat([m.down.to(dtype) for _, m in parts])
    up = torch.zeros(total_rows, total, *first.up.shape[2:], dtype=dtype)
    col = 0
    for (a, b), m in parts:
        block = m.up.to(dtype) if len(scales) == 1 else m.up.float() * (m.alpha / m.rank)
        up[a:b, col : col + m.rank] = block
        col += m.rank
    alpha = scales.pop() * total if len(scales) == 1 else float(total)
    name = first.name
    return LoraModule(first.component, name, down, up, alpha, "+".join(m.source for _, m in parts))
