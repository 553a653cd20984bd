"""`resize()`: a LoRA to a smaller (fixed or per-module dynamic) rank, as sd-scripts' resize_lora.py does.

Each module's ΔW/scale = up @ down is decomposed without forming it: QR of both factors, then the SVD of the small
r × r core (float64), so U·S·Vh is exact. The rule (converter.methods.ranks, capped by --rank) picks the rank;
up = U·S, down = Vh (kohya's layout) and alpha = old alpha / old rank × new rank, so the scale alpha/rank and hence
the kept part of ΔW are unchanged. The relative error ‖ΔW − ΔW_r‖/‖ΔW‖ of each module is √(ΣS²(dropped)/ΣS²).
A module already at or below its new rank is copied as it is. LoHa/LoKr/full deltas are first made LoRAs by an SVD
at --rank (as `converter convert --rank` does), with their error reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from converter.conversion.core import check_output_path
from converter.conversion.modules import LoraModule
from converter.conversion.names import BaseNames, base_names, collect
from converter.conversion.writers import write
from converter.formats import load_adapter
from converter.hub.sources import fetch
from converter.io.scratch import temp_folder
from converter.methods.options import ResizeOptions
from converter.methods.ranks import choose_rank, retained_energy


@dataclass
class ResizeResult:
    out: Path
    files: list[str]
    modules: int
    report: dict = field(default_factory=dict)  # module -> {old_rank, rank, relative_error, retained_energy}
    notes: list[str] = field(default_factory=list)


def lora_svd(up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U, S, Vh of up @ down (up (out, r, ..), down (r, in, ..) flattened) from QRs of the factors, in float64."""
    qu, ru = torch.linalg.qr(up.double().flatten(1))
    qd, rd = torch.linalg.qr(down.double().flatten(1).T)
    u, s, vh = torch.linalg.svd(ru @ rd.T)
    return qu @ u, s, vh @ qd.T


def resize_module(m: LoraModule, cap: int, rule: str = "fixed", param: float | None = None) -> tuple[LoraModule, dict]:
    """The module at the rank the rule picks (scale kept), and its facts."""
    u, s, vh = lora_svd(m.up, m.down)
    r = choose_rank(s, cap, rule, param)
    facts = {"old_rank": m.rank, "rank": min(r, m.rank), "retained_energy": retained_energy(s, r)}
    facts["relative_error"] = max(0.0, 1.0 - facts["retained_energy"]) ** 0.5
    if r >= m.rank:
        return m, {**facts, "retained_energy": 1.0, "relative_error": 0.0}
    up = (u[:, :r] * s[:r]).float().reshape(m.up.shape[0], r, *m.up.shape[2:])
    down = vh[:r].float().reshape(r, *m.down.shape[1:])
    alpha = m.alpha / m.rank * r
    resized = LoraModule(m.component, m.name, down.contiguous(), up.contiguous(), alpha, m.source, m.flat, m.prefix,
                         m.magnitude)  # fmt: skip
    return resized, facts


def resize(
    adapter: str,
    out: str | Path,
    options: ResizeOptions,
    *,
    token: str | None = None,
    log: Callable[[str], None] = print,
) -> ResizeResult:
    """Resize every module of the adapter at `adapter` (local or Hub) and write it at `out` as `options` say."""
    o = options
    out = Path(out)
    check_output_path(out, o.to, o.force)
    fetched = fetch(adapter, "adapter", token)
    loaded = load_adapter(fetched.local, allow_pickle=o.allow_pickle)
    with temp_folder("base-headers", log=log) as scratch:
        view = BaseNames(base_names(o.base, token, Path(scratch))) if o.base else None
        modules, svd = collect(loaded, view, o.to, rank=o.rank, component=o.component)
    resized, report = [], {}
    for m in modules:
        new, facts = resize_module(m, o.rank, o.rule, o.param)
        if m.source in svd:  # a LoHa/LoKr/full delta made a LoRA first: its error is that SVD's
            facts["relative_error"] = svd[m.source]
        resized.append(new)
        report[m.name] = facts
    errors = {k: v["relative_error"] for k, v in report.items()}
    source = {
        "resized_from": fetched.pinned if fetched.sha else Path(adapter).name,
        "rank": o.rank,
        "rank_rule": o.rule,
    }
    if o.param is not None:
        source["rank_param"] = o.param
    files = write(resized, o.to, out, force=o.force, source=source, svd=errors)
    worst = max(errors, key=errors.get)
    ranks = sorted({v["rank"] for v in report.values()})
    notes = [f"{len(report)} modules, rank {ranks[0]}" + (f"..{ranks[-1]}" if len(ranks) > 1 else "") +
             f" (was {sorted({v['old_rank'] for v in report.values()})}): relative error ‖ΔW − ΔW_r‖/‖ΔW‖ max "
             f"{errors[worst]:.3e} ({worst}), mean {sum(errors.values()) / len(errors):.3e}"]  # fmt: skip
    for note in notes:
        log(f"note: {note}")
    log(f"wrote {out}: {len(resized)} LoRA modules resized as {o.to} ({', '.join(files)})")
    return ResizeResult(out, files, len(resized), report, notes)
