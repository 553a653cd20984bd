"""`combine()`: several LoRA adapters into one adapter (not a model), with PEFT's `add_weighted_adapter` methods.

For each module, with wᵢ the adapter weight and sᵢ = alphaᵢ / rankᵢ its own scale:
- `cat`: downs wᵢ·sᵢ·Aᵢ stacked, ups Bᵢ side by side: ΔW = Σ wᵢ·ΔWᵢ exactly (rank = Σ ranks).
- `linear`, `ties`, `dare_linear`, `dare_ties`, `magnitude_prune`: the A's and the B's are merged separately
  (converter.engine.ties_dare) with weights ±√|wᵢsᵢ| on A and √|wᵢsᵢ| on B; every adapter's module needs the same
  rank. These act on factors, so ΔW is not the weighted sum: a cheap approximation, as in PEFT.
- `svd` and `<method>_svd`: the method applied to the full ΔWᵢ = sᵢ·Bᵢ·Aᵢ, then an SVD truncated to --rank (default:
  the largest input rank), U·S in B and Vh in A, optionally clamped at a quantile of their values (PEFT's svd_clamp).
  `svd`'s ΔW has rank <= Σ rᵢ, so its SVD comes from QRs of the stacked factors (float64, exact); the pruned ones
  are full rank and get a float32 SVD, like PEFT's on a float32 model.
The output has scale 1 per module (alpha = rank). A module only some adapters have is combined from those. One
adapter alone is combined with `linear`, as PEFT does. The input factors are read per adapter (adapter-sized);
one module's ΔW at a time is formed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from converter.conversion.core import check_output_path
from converter.conversion.modules import LoraModule
from converter.conversion.names import BaseNames, base_names, collect
from converter.conversion.writers import write
from converter.engine.ties_dare import combine_tensors, dare_mask
from converter.errors import AdapterFormatError, BadInputError
from converter.formats import load_adapter
from converter.hub.sources import fetch
from converter.io.scratch import temp_folder
from converter.methods.options import FACTOR_METHODS, CombineOptions
from converter.methods.resizing import lora_svd


@dataclass
class CombineResult:
    out: Path
    files: list[str]
    modules: int
    method: str
    notes: list[str] = field(default_factory=list)
    svd_errors: dict[str, float] = field(default_factory=dict)


def combine_module(
    parts: list[tuple[int, float, LoraModule]],
    method: str,
    *,
    rank: int,
    density: float | None = None,
    seed: int = 0,
    sign_method: str = "total",
    svd_clamp: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """(down, up, svd error or None) of one module from (adapter index, weight, module) parts; scale 1."""
    first = parts[0][2]
    where = (first.component, first.name)
    if method == "cat":
        down = torch.cat([m.down.float() * (w * m.alpha / m.rank) for _, w, m in parts])
        up = torch.cat([m.up.float() for _, _, m in parts], dim=1)
        return down, up, None
    if method in FACTOR_METHODS:
        ranks = {m.rank for _, _, m in parts}
        if len(ranks) > 1:
            raise BadInputError(
                f"module {first.name}: ranks {sorted(ranks)} differ; --method {method} merges the factors "
                "themselves, so every adapter needs the same rank there (use cat or svd)",
                tensor=first.name,
            )
        scaled = [w * m.alpha / m.rank for _, w, m in parts]
        wa = [math.copysign(math.sqrt(abs(x)), x) for x in scaled]
        wb = [math.sqrt(abs(x)) for x in scaled]
        out = []
        for side, weights in (("A", wa), ("B", wb)):
            tensors = [(m.down if side == "A" else m.up).float() for _, _, m in parts]
            masks = None
            if method.startswith("dare"):
                masks = [dare_mask(tuple(t.shape), density, seed, *where, side, i)
                         for (i, _, _), t in zip(parts, tensors, strict=True)]  # fmt: skip
            out.append(combine_tensors(tensors, weights, method, density, masks, sign_method))
        return out[0], out[1], None
    tail = first.down.shape[1:]
    if method == "svd":  # Σ wᵢ·ΔWᵢ has rank <= Σ rᵢ: its SVD from the stacked factors, exact and cheap
        up = torch.cat([m.up.float().flatten(1) for _, _, m in parts], dim=1)
        down = torch.cat([m.down.float().flatten(1) * (w * m.alpha / m.rank) for _, w, m in parts])
        return svd_factors(up.double() @ down.double(), rank, tail, svd_clamp, lora_svd(up, down))
    deltas = [_delta(m) for _, _, m in parts]
    masks = None
    if method.startswith("dare"):
        masks = [dare_mask(tuple(d.shape), density, seed, *where, "delta", i)
                 for (i, _, _), d in zip(parts, deltas, strict=True)]  # fmt: skip
    delta = combine_tensors(deltas, [w for _, w, _ in parts], method.removesuffix("_svd"), density, masks, sign_method)
    return svd_factors(delta, rank, tail, svd_clamp)


def _delta(m: LoraModule) -> torch.Tensor:
    """ΔW = alpha/rank · up @ down as an (out, in·k) float32 matrix."""
    return (m.up.float().flatten(1) @ m.down.float().flatten(1)) * (m.alpha / m.rank)


def svd_factors(
    delta: torch.Tensor, rank: int, down_tail: tuple[int, ...], clamp: float | None = None, usv=None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Rank-`rank` factors of an (out, in·k) ΔW: up = U·S, down = Vh (a float32 SVD, as PEFT's in float32, or the
    given `usv`), shaped like the input module's (conv: down (r, in, *k), up (out, r, 1, ..)); and the relative
    error of the float32 factors, measured in float64."""
    u, s, vh = usv if usv is not None else torch.linalg.svd(delta.float(), full_matrices=False)
    r = max(1, min(rank, s.numel()))
    up, down = u[:, :r] * s[:r], vh[:r]
    if clamp is not None:
        hi = torch.quantile(torch.cat([up.flatten(), down.flatten()]), clamp)
        up, down = up.clamp(-hi, hi), down.clamp(-hi, hi)
    up, down = up.float(), down.float()
    mat = delta.double()
    norm = torch.linalg.norm(mat)
    error = float(torch.linalg.norm(mat - up.double() @ down.double()) / norm) if norm > 0 else 0.0
    down = down.reshape(r, *down_tail)
    up = up.reshape(up.shape[0], r, *([1] * (len(down_tail) - 1)))
    return down.contiguous(), up.contiguous(), error


def combine(
    adapters: list[str],
    out: str | Path,
    options: CombineOptions | None = None,
    *,
    token: str | None = None,
    log: Callable[[str], None] = print,
) -> CombineResult:
    """Combine `adapters` (local or Hub) into one adapter written at `out`, as `options` say (default: their
    exact sum, `cat`, as PEFT)."""
    o = options or CombineOptions()
    weights = o.weights_for(adapters)
    out = Path(out)
    check_output_path(out, o.to, o.force)
    notes: list[str] = []
    method = o.method
    if len(adapters) == 1 and method != "linear":
        notes.append(f"one adapter: combined with linear, as PEFT's add_weighted_adapter does (not {method})")
        method = "linear"
    loaded, sources = _load_all(adapters, o, token, log)
    order: dict[tuple, list[tuple[int, float, LoraModule]]] = {}
    for i, modules in enumerate(loaded):
        for m in modules:
            if m.magnitude is not None:
                raise AdapterFormatError(
                    f"{adapters[i]}: {m.source} is DoRA; a combined adapter has no rule for the magnitude "
                    "vectors (PEFT's add_weighted_adapter drops them), so DoRA adapters are not combined",
                    file=adapters[i],
                    tensor=m.source,
                )
            order.setdefault((m.component, m.name), []).append((i, weights[i], m))
    target_rank = o.rank or max(m.rank for modules in loaded for m in modules)
    result: list[LoraModule] = []
    svd: dict[str, float] = {}
    for (comp, name), parts in order.items():
        down, up, error = combine_module(parts, method, rank=target_rank, density=o.density, seed=o.seed,
                                         sign_method=o.sign_method, svd_clamp=o.svd_clamp)  # fmt: skip
        first = parts[0][2]
        result.append(LoraModule(comp, name, down, up, float(down.shape[0]), first.source, first.flat, first.prefix))
        if error is not None:
            svd[name] = error
    if svd:
        worst = max(svd, key=svd.get)
        notes.append(f"{method}: truncated to rank {target_rank}: relative error ‖ΔW − ΔW_r‖/‖ΔW‖ max "
                     f"{svd[worst]:.3e} ({worst}), mean {sum(svd.values()) / len(svd):.3e}")  # fmt: skip
    source = {"combined_from": sources, "weights": weights, "method": method}
    extra = (("density", o.density), ("seed", o.seed if "dare" in method else None),
             ("majority_sign", o.sign_method if "ties" in method else None))  # fmt: skip
    source.update({k: v for k, v in extra if v is not None})
    files = write(result, o.to, out, force=o.force, source=source, svd=svd)
    for note in notes:
        log(f"note: {note}")
    log(f"wrote {out}: {len(result)} LoRA modules combined by {method} as {o.to} ({', '.join(files)})")
    return CombineResult(out, files, len(result), method, notes, svd)


def _load_all(adapters: list[str], o: CombineOptions, token: str | None, log) -> tuple[list, list[str]]:
    """Each adapter's modules named for the output (looked up on `o.base` when given), and a public name of each."""
    loaded, sources = [], []
    with temp_folder("base-headers", log=log) as scratch:
        view = BaseNames(base_names(o.base, token, Path(scratch))) if o.base else None
        for spec in adapters:
            fetched = fetch(spec, "adapter", token)
            adapter = load_adapter(fetched.local, allow_pickle=o.allow_pickle)
            modules, _ = collect(adapter, view, o.to, component=o.component)
            loaded.append(modules)
            sources.append(fetched.pinned if fetched.sha else Path(spec).name)
    return loaded, sources
