"""How many singular values a module keeps: a fixed rank, or one of kohya's dynamic rules, capped by --rank.

- `fixed`: the cap itself.
- `sv_ratio p`: keep the singular values larger than S₀ / p (p ≥ 1).
- `sv_fro p`: keep the fewest whose squares reach p² of ΣS² (p in (0, 1]: the Frobenius norm kept).
- `sv_cumulative p`: keep the fewest whose sum reaches p of ΣS (p in (0, 1]).
- `sv_epsilon e`: keep the singular values larger than e (mergekit-extract-lora's `--sv-epsilon`).

Unlike sd-scripts' resize_lora.py, a dynamic rule may keep every singular value (it never drops the last one
by construction); at least one is always kept.
"""

from __future__ import annotations

import torch


def choose_rank(s: torch.Tensor, cap: int, rule: str = "fixed", param: float | None = None) -> int:
    """The rank to keep for singular values `s` (descending), at most `cap` and at least 1."""
    s = s.double()
    n = min(cap, s.numel())
    if rule == "fixed" or s.numel() == 0 or float(s[0]) == 0.0:
        return max(1, n)
    if rule == "sv_ratio":
        keep = int((s > s[0] / param).sum())
    elif rule == "sv_epsilon":
        keep = int((s > param).sum())
    else:
        values = s.square() if rule == "sv_fro" else s
        target = param**2 if rule == "sv_fro" else param
        fraction = torch.cumsum(values, 0) / values.sum()
        # the fewest values whose share reaches the target (a hair of slack for the rounding of the cumsum)
        keep = int(torch.searchsorted(fraction, torch.tensor(target - 1e-12, dtype=fraction.dtype))) + 1
    return max(1, min(keep, n))


def retained_energy(s: torch.Tensor, rank: int) -> float:
    """ΣS²(kept) / ΣS²: the share of ‖ΔW‖²_F the kept singular values carry."""
    sq = s.double().square()
    total = float(sq.sum())
    return float(sq[:rank].sum()) / total if total > 0 else 1.0
