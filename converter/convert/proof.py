"""A conversion proves its output: the written adapter is read back and each module's ΔW compared with the
source's, so `convert` prints "ΔW identical on N modules" or fails (exit 3) instead of writing a silent error.

The output is read back with converter's own format readers (the same ones `merge` uses), the source's ΔW comes
from the source file: names are compared per component after kohya-style flattening (`.` -> `_`, CLIP's
`text_model.` dropped), so a module renamed on the way still meets its source (by name alone where one side names
no component and the name is unique). Modules fused or split on the way (BFL qkv <-> to_q/to_k/
to_v) have no one-to-one counterpart and are counted, not compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from converter.errors import VerificationFailed
from converter.formats import Adapter, load_adapter

# ΔW = scale · up @ down in float32: the scale may be recomputed from a stored alpha (alpha / rank) and the
# product taken in another order by another format's reader: a few float32 roundings.
FLOAT32_ROUNDING = 4 * 2.0**-24


@dataclass
class Proof:
    identical: int
    within_rounding: int
    approximated: int  # SVD-approximated modules, checked against their reported reconstruction error
    not_compared: int
    worst: tuple[str, float] | None

    @property
    def compared(self) -> int:
        return self.identical + self.within_rounding + self.approximated

    def summary(self) -> str:
        if not self.compared:
            return (
                f"ΔW not compared: none of the {self.not_compared} modules keeps its name (fused/split on the "
                "way); the conversion is not proven"
            )
        parts = [f"ΔW identical on {self.identical} modules"]
        if self.within_rounding:
            parts.append(f"{self.within_rounding} within float32 rounding")
        if self.approximated:
            parts.append(f"{self.approximated} SVD-approximated within their reported error")
        if self.not_compared:
            parts.append(f"{self.not_compared} fused/split modules without a one-to-one counterpart not compared")
        return "; ".join(parts) + " (read back with converter's readers)"


def key(component: str | None, module: str) -> tuple[str, str]:
    flat = module.replace(".", "_")
    for prefix in ("text_model_", "base_model_model_"):
        flat = flat.removeprefix(prefix)
    return (component or "denoiser", flat)


def deltas(adapter: Adapter) -> dict[tuple[str, str], object]:
    return {key(ap.component, ap.module): ap for ap in adapter.patches if ap.param == "weight"}


def prove(source: Adapter, out: Path, svd: dict[str, float] | None = None) -> Proof:
    """Compare every module's ΔW in `out` (read back) with the source's; VerificationFailed on a mismatch."""
    import torch

    written = deltas(load_adapter(out))
    original = deltas(source)
    by_name: dict[str, list] = {}
    for (_, flat), ap in written.items():
        by_name.setdefault(flat, []).append(ap)
    identical = within = approximated = 0
    worst: tuple[str, float] | None = None
    for k, ap in original.items():
        other = written.get(k)
        if other is None and len(by_name.get(k[1], ())) == 1:  # one side names no component (--component)
            other = by_name[k[1]][0]
        if other is None:
            continue
        a, b = _tensor(ap.patch), _tensor(other.patch)
        if a is None or b is None:
            continue
        name = f"{k[0]}:{ap.module}"
        if a.shape != b.shape:
            raise VerificationFailed(
                f"{out}: module {name} has ΔW of shape {list(b.shape)}, the source's is "
                f"{list(a.shape)}; the conversion is wrong (please report it)"
            )
        if torch.equal(a, b):
            identical += 1
            continue
        err = ((a - b).norm() / a.norm().clamp_min(1e-30)).item()
        worst = max(worst or (name, err), (name, err), key=lambda t: t[1])
        allowed = (svd or {}).get(ap.native or "", (svd or {}).get(ap.module))
        if allowed is not None and err <= allowed + FLOAT32_ROUNDING * 4:
            approximated += 1
        elif allowed is None and err <= FLOAT32_ROUNDING:
            within += 1
        else:
            limit = FLOAT32_ROUNDING if allowed is None else allowed
            raise VerificationFailed(
                f"{out}: module {name}'s ΔW differs from the source's (relative error "
                f"{err:.3g} > {limit:.3g}); the conversion is wrong (please report it)"
            )
    proof = Proof(identical, within, approximated, len(original) - identical - within - approximated, worst)
    return proof


def _tensor(patch):
    """What defines the module: ΔW, and for DoRA ΔW and the magnitude vector side by side (None: not a delta)."""
    import torch

    from converter.patches import DeltaPatch, DoRA

    if isinstance(patch, DoRA):
        return torch.cat([patch.lora.delta(transposed=False).flatten(), patch.magnitude.load().flatten()])
    return patch.delta(transposed=False) if isinstance(patch, DeltaPatch) else None
