"""The referee of last resort for a diffusion merge: where diffusers cannot apply an adapter unmerged (its loader
refuses the file, the family has no loader, it would misread per-module alphas, include/exclude), every touched
tensor is recomputed in float64 from the base tensor and the adapter file's own factors by the format's published
formula (kohya / LyCORIS / PEFT, docs/FORMATS.md §1, §3, §7), and the merged tensor must equal it to within the
rounding of its dtype. Nothing of our patch math (`converter.patches`) is used: the factors are grouped from the
file's key names here, their alpha read here, the product computed here. Where each module lands is the merge
plan's name lookup (the keymap), the one thing shared with the merge; it is said in the report.

Bounds, per element, from standard floating-point error analysis: the merge computes W + Σ w·s·f(factors) in
float32 (each sum of n products off by at most n·u32 of the sum of absolute products, γ_n) and rounds once to
the output dtype (u_out of the value). Untouched tensors must be the base's, cast to the output dtype.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

from converter.records import REPORT_FILE

REFERENCE = "published formula, float64"
UNIT_ROUNDOFF = {"F64": 2.0**-53, "F32": 2.0**-24, "F16": 2.0**-11, "BF16": 2.0**-8}
# Half the spacing of the smallest (subnormal) numbers: rounding near zero is off by this much, not by u·|x|
# (fp16's subnormals start at 6.1e-5, where many small weights live).
SUBNORMAL_HALF_SPACING = {"F64": 2.0**-1075, "F32": 2.0**-150, "F16": 2.0**-25, "BF16": 2.0**-134}
U32 = 2.0**-24
GAMMA_SLACK = 8  # γ_n with n = the longest inner product + this many additions (weights, alpha, adapters)
MAX_PROBLEMS = 10  # tensors named one by one in the report; the rest are counted
EFFECT_SHARE = 0.25  # the merged tensor must sit this much closer to the reference than the base does

# The writers' own key suffixes (kohya sd-scripts, LyCORIS, PEFT / diffusers): role of each factor.
SUFFIXES = {
    ".lora_down.weight": "down",
    ".lora_up.weight": "up",
    ".lora_mid.weight": "mid",
    ".lora_A.weight": "down",
    ".lora_B.weight": "up",
    ".lora_A.default.weight": "down",
    ".lora_B.default.weight": "up",
    ".alpha": "alpha",
    ".dora_scale": "dora",
    ".lora_magnitude_vector": "dora",
    ".diff_b": "diff_b",
    ".diff": "diff",
    **{f".{k}": k for k in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")},
    **{f".{k}": k for k in ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")},
}


class Unsupported(Exception):
    """A patch this referee has no published formula for (DoRA, OFT, patterned PEFT alphas ...)."""


def split(key: str) -> tuple[str, str] | None:
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if key.endswith(suffix):
            return key[: -len(suffix)], SUFFIXES[suffix]
    return None


class AdapterFactors:
    """An adapter's tensors grouped by module stem from their key names, and its scale rule."""

    def __init__(self, adapter, lora_alpha: float | None):
        self.tensors = adapter.tensors
        self.groups: dict[str, dict[str, str]] = {}
        for key in self.tensors.names():
            if (found := split(key)) is not None:
                self.groups.setdefault(found[0], {})[found[1]] = key
        if "(components)" in adapter.format:  # unet/ + text_encoder/ PEFT folders: a config each
            raise Unsupported("a multi-component PEFT folder (one adapter_config.json per component)")
        self.config = _peft_config(Path(adapter.path))
        self.lora_alpha = lora_alpha
        self.metadata = getattr(getattr(self.tensors, "file", None), "metadata", {}) or {}

    def read(self, key: str):
        import torch

        return self.tensors.read(key).to(torch.float64)

    def group(self, source: str) -> dict[str, str]:
        found = split(source)
        if found is None:
            raise Unsupported(f"{source}: no published formula for this tensor kind")
        return self.groups[found[0]]

    def alpha_scale(self, roles: dict[str, str], rank: int) -> float:
        """kohya / LyCORIS: alpha / rank, alpha missing or 0 meaning rank; PEFT: lora_alpha / r from its config."""
        if "alpha" in roles:
            alpha = float(self.read(roles["alpha"]).item())
            return 1.0 if alpha == 0 else alpha / rank
        if ".lora_A." not in roles.get("down", ""):
            if self.config is not None:
                raise Unsupported("a PEFT adapter other than LoRA: its alpha is in adapter_config.json")
            return 1.0
        if self.config is not None:
            if self.config.get("rank_pattern") or self.config.get("alpha_pattern"):
                raise Unsupported("PEFT rank/alpha patterns: no single published scale")
            alpha = float(self.config["lora_alpha"])
            return alpha / math.sqrt(rank) if self.config.get("use_rslora") else alpha / rank
        if "lora_adapter_metadata" in self.metadata:  # diffusers' save: LoraConfig fields, prefixed per component
            return self._metadata_scale(split(roles["down"])[0].split(".")[0], rank)
        if self.lora_alpha is not None:
            return float(self.lora_alpha) / rank
        return 1.0  # diffusers' files without alpha: scale 1

    def _metadata_scale(self, component: str, rank: int) -> float:
        try:
            meta = json.loads(self.metadata["lora_adapter_metadata"])
        except json.JSONDecodeError:
            raise Unsupported("lora_adapter_metadata is not JSON") from None

        def get(field):
            return meta.get(f"{component}.{field}", meta.get(field))

        if get("alpha_pattern") or get("rank_pattern"):
            raise Unsupported("rank/alpha patterns in lora_adapter_metadata: no single published scale")
        alpha = get("lora_alpha")
        if not isinstance(alpha, int | float):
            raise Unsupported("lora_adapter_metadata without a lora_alpha")
        return alpha / math.sqrt(rank) if get("use_rslora") else alpha / rank


def _peft_config(path: Path) -> dict | None:
    """PEFT's adapter_config.json of a PEFT folder (or of its adapter_model.safetensors); a community file that
    happens to sit next to one keeps its own alphas."""
    if not path.is_dir() and path.name != "adapter_model.safetensors":
        return None
    config = path / "adapter_config.json" if path.is_dir() else path.parent / "adapter_config.json"
    return json.loads(config.read_text()) if config.is_file() else None


def delta(f: AdapterFactors, roles: dict[str, str], bias: bool, magnitude: bool = False):
    """(ΔW or Δb in float64, inner length n) by the published formula; `magnitude`: the same formula over the
    factors' absolute values (the sum of absolute products that bounds float32's error)."""
    import torch

    def t(role):
        x = f.read(roles[role])
        return x.abs() if magnitude else x

    if "dora" in roles:
        raise Unsupported("DoRA (the norm of the merged weight) is not recomputed here")
    if bias:
        if "diff_b" not in roles:
            raise Unsupported("a bias delta other than LyCORIS diff_b")
        return t("diff_b"), 1
    if "diff" in roles:  # LyCORIS full: ΔW = diff
        return t("diff"), 1
    if "down" in roles:  # LoRA / LoCon: ΔW = alpha/r · up @ down (Tucker: mid between)
        down, up = t("down"), t("up")
        rank = down.shape[0]
        scale = abs(f.alpha_scale(roles, rank)) if magnitude else f.alpha_scale(roles, rank)
        up2 = up.reshape(up.shape[0], -1)
        if "mid" in roles:
            mid = t("mid")
            d = torch.einsum("ij...,ip,jr->pr...", mid, up2.T, down.reshape(rank, -1))
            return scale * d, rank * rank
        return scale * (up2 @ down.reshape(rank, -1)), rank
    if "hada_w1_a" in roles:  # LoHa: ΔW = alpha/r · (w1a @ w1b) ⊙ (w2a @ w2b)
        rank = f.tensors.shape(roles["hada_w1_b"])[0]
        scale = f.alpha_scale(roles, rank)
        scale = abs(scale) if magnitude else scale
        if "hada_t1" in roles:
            one = torch.einsum("ij...,jr,ip->pr...", t("hada_t1"), t("hada_w1_b"), t("hada_w1_a"))
            two = torch.einsum("ij...,jr,ip->pr...", t("hada_t2"), t("hada_w2_b"), t("hada_w2_a"))
            return scale * one * two, 2 * rank * rank + 1
        return scale * (t("hada_w1_a") @ t("hada_w1_b")) * (t("hada_w2_a") @ t("hada_w2_b")), 2 * rank + 1
    if any(r.startswith("lokr_") for r in roles):  # LoKr: ΔW = scale · kron(w1, w2)
        rank, parts = None, []
        for i in ("1", "2"):
            if f"lokr_w{i}" in roles:
                parts.append(t(f"lokr_w{i}"))
                continue
            a, b = t(f"lokr_w{i}_a"), t(f"lokr_w{i}_b")
            rank = b.shape[0]  # LyCORIS / ComfyUI: the decomposed factor's rank (the last one wins)
            if i == "2" and "lokr_t2" in roles:
                parts.append(torch.einsum("ij...,jr,ip->pr...", t("lokr_t2"), b, a))
            else:
                parts.append(a @ b.reshape(b.shape[0], -1))
        w1, w2 = parts
        scale = 1.0 if rank is None else f.alpha_scale(roles, rank)  # both factors full: alpha forced to rank
        scale = abs(scale) if magnitude else scale
        while w1.dim() < w2.dim():
            w1 = w1.unsqueeze(-1)
        return scale * torch.kron(w1, w2), (rank or 1) * (rank or 1) + 1
    raise Unsupported(f"no published formula for a module with {', '.join(sorted(roles))}")


def verify_formula(
    merged: Path,
    recipe,
    base: Path,
    reason: str,
    *,
    token: str | None = None,
    log: Callable[[str], None] = print,
    on_reference: Callable[[str, object], None] | None = None,
) -> dict:
    """Check every tensor of the merged output against base + published formula; writes and returns the report.
    `on_reference(name, tensor)` receives each touched tensor's reference (float64) as it is computed: the caller
    can build a reference pipeline from them for images. Raises Unsupported when some patch has no published
    formula here (the caller then reports a skip)."""
    import torch

    from converter.checkpoint import open_base
    from converter.formats import load_adapter
    from converter.plan import plan_merge
    from converter.sources import fetch

    started = time.time()
    specs = recipe.adapters
    adapters = [
        (
            load_adapter(
                fetch(s.source, "adapter", token).local, allow_pickle=recipe.allow_pickle, lora_alpha=s.lora_alpha
            ),
            s,
        )
        for s in specs
    ]
    checkpoint = open_base(base, allow_pickle=recipe.allow_pickle)
    plan, _, _ = plan_merge(recipe, checkpoint, adapters, [None] * len(adapters))
    out = open_base(merged / base.name if base.is_file() else merged)
    factors = [AdapterFactors(a, s.lora_alpha) for a, s in adapters]
    owner = {id(ap.patch): ap for a, _ in adapters for ap in a.patches}
    log(f"verifying {merged.name}: reference = base + adapters by the {REFERENCE} ({reason})")

    problems, notes, tensors, culprit = [], [], {}, None
    per_component: dict[str, dict] = {}
    untouched = failed = 0
    names = set(out.names())
    missing = [o.name for o in plan.outputs if o.name not in names]
    extra = sorted(names - {o.name for o in plan.outputs})
    if missing or extra:
        problems.append(
            f"the merge's tensors are not the base's: {len(missing)} missing (e.g. {(missing or ['-'])[0]}), "
            f"{len(extra)} not in the base (e.g. {(extra or ['-'])[0]})"
        )
    try:
        for o in (o for o in plan.outputs if o.name in names):
            stored = out.info(o.name).dtype
            if not o.patches:  # compared as stored: the base's tensor cast to the output dtype, bit for bit
                untouched += 1
                m, w = out.read(o.name), checkpoint.read(o.source.name)
                if not torch.equal(m, w.to(_torch_dtype(stored))):
                    problems.append(f"{o.name} was not to be touched but differs from the base")
                    culprit = culprit or {"module": _module(o.name), "relative_error": _rel(m.double(), w.double())}
                continue
            m = out.read(o.name).to(torch.float64)
            w = checkpoint.read(o.source.name).to(torch.float64)
            ref, mag, inner = w.clone(), w.abs(), 0
            for p in o.patches:
                inner_patch = getattr(p.patch, "inner", p.patch)
                ap = owner[id(inner_patch)]
                spec = specs[p.adapter]
                weight = spec.weight_for(o.name.split("/", 1)[0] if "/" in o.name else ap.component)
                f = factors[p.adapter]
                roles = f.group(inner_patch.sources[0])
                d, n = delta(f, roles, ap.param == "bias")
                a, _ = delta(f, roles, ap.param == "bias", magnitude=True)
                if p.patch is not inner_patch:  # rows of a fused module landing on a separate tensor
                    d, a = d[p.patch.start : p.patch.end], a[p.patch.start : p.patch.end]
                if p.transposed:
                    d, a = d.T, a.T
                rows = slice(None) if p.rows is None else slice(*p.rows)
                shape = ref[rows].shape
                if d.numel() != math.prod(shape):
                    raise Unsupported(f"{inner_patch.sources[0]}: shape {list(d.shape)} onto {list(shape)}")
                ref[rows] += weight * d.reshape(shape)
                mag[rows] += abs(weight) * a.reshape(shape)
                inner = max(inner, n)
            if on_reference is not None:
                on_reference(o.name, ref)
            u = UNIT_ROUNDOFF.get(stored, 2.0**-8)  # |fl(y) - R| <= u|y| + |y - R|, |y - R| <= γ·mag
            bound = u * ref.abs() + (1 + u) * (inner + GAMMA_SLACK) * U32 * mag
            bound = bound + SUBNORMAL_HALF_SPACING.get(stored, 0.0) + 2.0**-150  # float32's own subnormals too
            ratio = ((m - ref).abs() / bound).max().item()
            effect = ((w - ref).abs() / bound).max().item()
            row = {
                "dtype": stored,
                "max_error_over_bound": round(ratio, 4),
                "base_error_over_bound": round(effect, 4),
                "rel_err": _rel(m, ref),
                "base_rel_err": _rel(w, ref),
                "max_abs": (m - ref).abs().max().item(),
            }
            tensors[o.name] = row
            component = o.name.split("/", 1)[0] if "/" in o.name else (owner_component(o, owner) or "model")
            c = per_component.setdefault(component, {"tensors": 0, "failed": 0, "max_error_over_bound": 0.0,
                                                     "base_vs_reference_max": 0.0})  # fmt: skip
            c["tensors"] += 1
            c["max_error_over_bound"] = max(c["max_error_over_bound"], row["max_error_over_bound"])
            c["base_vs_reference_max"] = max(c["base_vs_reference_max"], row["base_error_over_bound"])
            if effect <= 1:
                notes.append(f"{o.name}: the adapters change it by less than its rounding")
            if ratio > 1:
                c["failed"] += 1
                failed += 1
                if failed > MAX_PROBLEMS:
                    culprit = culprit or {"module": _module(o.name), "relative_error": row["rel_err"]}
                    continue
                what = "as far from the reference as the base (was anything merged?)" if (
                    row["rel_err"] >= EFFECT_SHARE * row["base_rel_err"]) else "off"  # fmt: skip
                problems.append(
                    f"{o.name}: {what}: error {ratio:.3g}x its rounding bound (relative error {row['rel_err']:.3g}, "
                    f"the adapters' own effect {row['base_rel_err']:.3g})"
                )
                culprit = culprit or {"module": _module(o.name), "relative_error": row["rel_err"]}
    except Unsupported as e:
        log(f"no {REFERENCE} reference either: {e}")
        raise
    if failed > MAX_PROBLEMS:
        problems.append(f"... and {failed - MAX_PROBLEMS} more tensors off")
    if culprit:
        problems.append(f"first module that disagrees: {culprit['module']}")
    report = {
        "kind": "diffusion",
        "verdict": "fail" if problems else "pass",
        "problems": problems,
        "notes": notes[:20] + ([f"... and {len(notes) - 20} more such tensors"] if len(notes) > 20 else []),
        "reference": REFERENCE,
        "reference_reason": reason,
        "compute_dtype": "float64",
        "output_dtype": ", ".join(sorted({r["dtype"] for r in tensors.values()})) or "?",
        "components": per_component,
        "tensors_checked": len(tensors),
        "untouched_identical": untouched if not any("not to be touched" in p for p in problems) else None,
        "worst_tensors": dict(sorted(tensors.items(), key=lambda kv: -kv[1]["max_error_over_bound"])[:5]),
        "first_disagreeing_module": culprit,
        "images": [],
        "seconds": round(time.time() - started, 1),
    }
    report["markdown"] = markdown(report)
    (merged / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


def owner_component(o, owner: dict) -> str | None:
    p = o.patches[0].patch
    ap = owner.get(id(getattr(p, "inner", p)))
    return ap.component if ap else None


def _module(name: str) -> str:
    return name.replace("/", ".").removesuffix(".weight").removesuffix(".bias")


def _rel(x, ref) -> float:
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _torch_dtype(st: str):
    from converter.dtypes import ST_TO_TORCH

    return ST_TO_TORCH[st]


def markdown(report: dict) -> str:
    verdict = {"pass": "**Passed**", "fail": "**FAILED**"}[report["verdict"]]
    lines = [
        f"{verdict} (reference: {REFERENCE}): diffusers could not referee this merge ({report['reference_reason']}). "
        "Every touched tensor was recomputed in float64 from the base and the adapter file's own factors by the "
        "format's published formula and compared element by element with the merged one, against a bound from "
        "float32 compute and one rounding to the output dtype (module placement: the keymap's name lookup, as in "
        "the merge).",
        "",
        "| component | tensors | worst error / rounding bound | base vs reference (worst, / bound) | pass if |",
        "|---|---|---|---|---|",
    ]
    for name, c in report["components"].items():
        lines.append(
            f"| {name} | {c['tensors']} | {c['max_error_over_bound']:.3g} | {c['base_vs_reference_max']:.3g} | ≤ 1 |"
        )
    if report.get("untouched_identical") is not None:
        lines.append(f"\n{report['untouched_identical']} untouched tensors are the base's (cast to the output dtype).")
    if report["images"]:
        psnr = ", ".join(f"{i['psnr']:.1f} dB (max {i['max_abs']})" for i in report["images"])
        lines.append(
            f"\nImages (fixed seed, a few steps) of the base, the reference (the base pipeline holding the "
            f"formula's weights) and the merge; merged vs reference PSNR: {psnr}."
        )
    for p in report["problems"]:
        lines.append(f"\n- problem: {p}")
    for n in report["notes"]:
        lines.append(f"\n- note: {n}")
    return "\n".join(lines)
