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

from converter.conversion.core import TARGETS, check_output_path
from converter.conversion.modules import LoraModule
from converter.conversion.names import BaseNames, base_names, collect
from converter.conversion.writers import write
from converter.engine.ties_dare import combine_tensors, dare_mask
from converter.errors import AdapterFormatError, BadInputError, UsageError
from converter.formats import load_adapter
from converter.hub.sources import fetch
from converter.io.scratch import temp_folder
from converter.methods.options import FACTOR_METHODS, METHODS, NEEDS_DENSITY, SVD_METHODS
from converter.methods.resizing import lora_svd


@dataclass
class CombineResult:
    out: Path
    files: list[str]
    modules: int
    method: str
    notes: list[str] = field(default_factory=list)
    svd_errors: dict[str, float] = field(default_factory=dict)


def check_options(method: str, n: int, density: float | None, rank: int | None, svd_clamp: float | None) -> None:
    """Every option problem as a one-line error, before an adapter is read."""
    if method not in METHODS:
        raise UsageError(f"--method {method}: choose one of {', '.join(METHODS)}")
    if n < 1:
        raise UsageError("combine needs at least one --adapter")
    base = method.removesuffix("_svd")
    if base in NEEDS_DENSITY and density is None:
        raise UsageError(f"--method {method} needs --density (the fraction of values kept, in (0, 1])")
    if density is not None and not 0 < density <= 1:
        raise UsageError(f"--density {density}: give the fraction of values kept, in (0, 1]")
    if rank is not None and method not in SVD_METHODS:
        raise UsageError(f"--rank applies to the svd methods only; {method} keeps the input ranks")
    if rank is not None and rank < 1:
        raise UsageError(f"--rank {rank}: give a positive rank")
    if svd_clamp is not None and (method not in SVD_METHODS or not 0 < svd_clamp <= 1):
        raise UsageError("--svd-clamp is a quantile in (0, 1] and applies to the svd methods only")


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
    *,
    weights: list[float] | None = None,
    method: str = "cat",
    density: float | None = None,
    rank: int | None = None,
    seed: int = 0,
    sign_method: str = "total",
    svd_clamp: float | None = None,
    to: str = "peft",
    base: str | None = None,
    component: str | None = None,
    force: bool = False,
    token: str | None = None,
    allow_pickle: bool = False,
    log: Callable[[str], None] = print,
) -> CombineResult:
    """Combine `adapters` (local or Hub) with `weights` by `method` into one adapter written at `out` as `to`."""
    weights = list(weights) if weights else [1.0] * len(adapters)
    if len(weights) != len(adapters):
        raise UsageError(f"{len(weights)} --weight for {len(adapters)} --adapter: give one per adapter")
    if sign_method not in ("total", "frequency"):
        raise UsageError(f"--majority-sign {sign_method}: choose total or frequency")
    if to not in TARGETS:
        raise UsageError(f"--to {to}: choose one of {', '.join(TARGETS)}")
    check_options(method, len(adapters), density, rank, svd_clamp)
    out = Path(out)
    check_output_path(out, to, force)
    notes: list[str] = []
    if len(adapters) == 1 and method != "linear":
        notes.append(f"one adapter: combined with linear, as PEFT's add_weighted_adapter does (not {method})")
        method = "linear"
    loaded, sources = _load_all(adapters, base, to, component, token, allow_pickle, log)
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
    target_rank = rank or max(m.rank for modules in loaded for m in modules)
    result: list[LoraModule] = []
    svd: dict[str, float] = {}
    for (comp, name), parts in order.items():
        down, up, error = combine_module(parts, method, rank=target_rank, density=density, seed=seed,
                                         sign_method=sign_method, svd_clamp=svd_clamp)  # fmt: skip
        first = parts[0][2]
        result.append(LoraModule(comp, name, down, up, float(down.shape[0]), first.source, first.flat, first.prefix))
        if error is not None:
            svd[name] = error
    if svd:
        worst = max(svd, key=svd.get)
        notes.append(f"{method}: truncated to rank {target_rank}: relative error ‖ΔW − ΔW_r‖/‖ΔW‖ max "
                     f"{svd[worst]:.3e} ({worst}), mean {sum(svd.values()) / len(svd):.3e}")  # fmt: skip
    source = {"combined_from": sources, "weights": weights, "method": method}
    extra = (("density", density), ("seed", seed if "dare" in method else None),
             ("majority_sign", sign_method if "ties" in method else None))  # fmt: skip
    source.update({k: v for k, v in extra if v is not None})
    files = write(result, to, out, force=force, source=source, svd=svd)
    for note in notes:
        log(f"note: {note}")
    log(f"wrote {out}: {len(result)} LoRA modules combined by {method} as {to} ({', '.join(files)})")
    return CombineResult(out, files, len(result), method, notes, svd)


def _load_all(adapters, base, to, component, token, allow_pickle, log) -> tuple[list[list[LoraModule]], list[str]]:
    """Each adapter's modules named for the output (looked up on `base` when given), and a public name of each."""
    loaded, sources = [], []
    with temp_folder("base-headers", log=log) as scratch:
        view = BaseNames(base_names(base, token, Path(scratch))) if base else None
        for spec in adapters:
            fetched = fetch(spec, "adapter", token)
            adapter = load_adapter(fetched.local, allow_pickle=allow_pickle)
            modules, _ = collect(adapter, view, to, component=component)
            loaded.append(modules)
            sources.append(fetched.pinned if fetched.sha else Path(spec).name)
    return loaded, sources
