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

from converter import outcome
from converter.errors import VerificationFailed
from converter.formats import Adapter, load_adapter
from converter.formats.patches import DeltaPatch, DoRA

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
    on_base: int = 0  # base tensors compared (both files looked up on the base); 0: compared per module name

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
        how = "read back with converter's readers" + (
            f", both looked up on the base: {self.on_base} base tensors compared" if self.on_base else ""
        )
        return "; ".join(parts) + f" ({how})"

    def as_proofs(self) -> outcome.Proofs:
        """For a verb's outcome (converter.outcome): the counts, typed."""
        name, error = self.worst or (None, None)
        return outcome.Proofs(
            conversion=outcome.ConversionProof(
                identical=self.identical,
                within_rounding=self.within_rounding,
                approximated=self.approximated,
                not_compared=self.not_compared,
                worst_module=name,
                worst_error=error,
                on_base=self.on_base,
            )
        )


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


def prove_on_base(source: Adapter, out: Path, base, svd: dict[str, float] | None = None) -> Proof:
    """With the base at hand: both adapters' ΔW summed onto each base tensor they change (the merge's own name
    lookup, rows of fused tensors included) must agree tensor by tensor, whatever the names or the fused/split
    layout on each side. VerificationFailed on a mismatch; DoRA (its ΔW needs the base weight) is compared by name."""
    import torch

    written = load_adapter(out)
    if any(not _plain(ap.patch) for a in (source, written) for ap in a.patches):
        return prove(source, out, svd)
    ours, theirs = _on_base(source, base), _on_base(written, base)
    if set(ours) != set(theirs):
        gone, new = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
        raise VerificationFailed(
            f"{out}: the converted file changes other base tensors than the source ({(gone or new)[0]} "
            f"{'lost' if gone else 'added'}); the conversion is wrong (please report it)"
        )
    identical = within = approximated = 0
    worst: tuple[str, float] | None = None
    for key, parts in ours.items():
        shape = tuple(base.checkpoint.info(key).shape)
        a, b = _summed(parts, shape), _summed(theirs[key], shape)
        modules = len({ap.native or ap.module for _, ap in parts})
        if torch.equal(a, b):
            identical += modules
            continue
        err = ((a - b).norm() / a.norm().clamp_min(1e-30)).item()
        worst = max(worst or (key, err), (key, err), key=lambda t: t[1])
        allowed = max((svd or {}).get(ap.native or "", (svd or {}).get(ap.module, -1.0)) for _, ap in parts)
        if allowed >= 0 and err <= allowed + FLOAT32_ROUNDING * 4:
            approximated += modules
        elif allowed < 0 and err <= FLOAT32_ROUNDING:
            within += modules
        else:
            limit = FLOAT32_ROUNDING if allowed < 0 else allowed
            raise VerificationFailed(
                f"{out}: base tensor {key}'s ΔW differs from the source's (relative error "
                f"{err:.3g} > {limit:.3g}); the conversion is wrong (please report it)"
            )
    return Proof(identical, within, approximated, 0, worst, on_base=len(ours))


def _plain(patch) -> bool:
    return isinstance(patch, DeltaPatch) and not getattr(patch, "flip", False)


def _on_base(adapter: Adapter, base) -> dict[str, list]:
    """Base tensor -> [(placement, patch)] of every weight delta the adapter puts on it."""
    out: dict[str, list] = {}
    for ap in adapter.patches:
        if ap.param != "weight":
            continue
        for place in base.places(ap):
            out.setdefault(place.key, []).append((place, ap))
    return out


def _summed(parts: list, shape: tuple[int, ...]):
    import torch

    total = torch.zeros(shape, dtype=torch.float64)
    for place, ap in parts:
        d = ap.patch.delta(transposed=False).double()
        if place.src is not None:
            d = d[place.src[0] : place.src[1]]
        view = total if place.rows is None else total[place.rows[0] : place.rows[1]]
        view += d.reshape(view.shape)
    return total


def _tensor(patch):
    """What defines the module: ΔW, and for DoRA ΔW and the magnitude vector side by side (None: not a delta)."""
    import torch

    if isinstance(patch, DoRA):
        return torch.cat([patch.lora.delta(transposed=False).flatten(), patch.magnitude.load().flatten()])
    return patch.delta(transposed=False) if isinstance(patch, DeltaPatch) else None
