"""The referee of last resort: where neither PEFT nor diffusers can apply an adapter unmerged (community files
on an LLM, diffusers refusing or misreading a file, include/exclude, a single-file base, MoE expert slices),
every changed tensor is recomputed in float64 from the base tensor and the adapter file's own factors by the
format's published formula (kohya / LyCORIS / PEFT / DoRA, docs/FORMATS.md §1, §3, §7). Nothing of our patch
math (`converter.formats.patches`) is used: the factors are grouped from the file's key names here, their alpha read
here, the product computed here. Where each module lands is the merge plan's name lookup (the keymap), the one
thing shared with the merge: the report says so.

Allowance, per element: the merge computes W + Σ w·s·f(factors) in float32, each sum of n products off by at
most γ_n of the sum of absolute products (and the sum with W by a few roundings of |W|); the tensor proof adds
the rounding to the output dtype (tensors.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from converter.engine.base_reader import open_base
from converter.engine.plan import plan_merge
from converter.formats import load_adapter
from converter.verification.referee import Expectation, Expected, RefereeInfo, RefereeUnavailable, gamma

REFERENCE = "published formula"

# The writers' own key suffixes (kohya sd-scripts, LyCORIS, PEFT / diffusers): role of each factor.
SUFFIXES = {
    ".lora_down.weight": "down",
    ".lora_up.weight": "up",
    ".lora_mid.weight": "mid",
    ".lora_A.weight": "down",
    ".lora_B.weight": "up",
    ".lora_A.default.weight": "down",
    ".lora_B.default.weight": "up",
    # diffusers before PEFT: attention processors (`to_q_lora.down`), `.lora.down`, `lora_linear_layer.down`
    "_lora.down.weight": "down",
    "_lora.up.weight": "up",
    ".lora.down.weight": "down",
    ".lora.up.weight": "up",
    ".lora_linear_layer.down.weight": "down",
    ".lora_linear_layer.up.weight": "up",
    ".alpha": "alpha",
    ".dora_scale": "dora",
    ".lora_magnitude_vector": "magnitude",
    ".lora_magnitude_vector.weight": "magnitude",
    ".diff_b": "diff_b",
    ".diff": "diff",
    **{f".{k}": k for k in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")},
    **{f".{k}": k for k in ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")},
}


class Unsupported(RefereeUnavailable):
    """A patch this referee has no published formula for (OFT, patterned PEFT alphas ...)."""


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


def delta(f: AdapterFactors, roles: dict[str, str], bias: bool, magnitude: bool = False, experts: int = 0):
    """(ΔW or Δb in float64, inner length n) by the published formula (a DoRA module's ΔW before its norm);
    `magnitude`: the same formula over the factors' absolute values (the sum of absolute products that bounds
    float32's error); `experts`: a PEFT LoRA on fused experts, ΔW (E, out, in) (PEFT's layout: A's rows expert
    after expert, B's columns interleaved)."""
    import torch

    def t(role):
        x = f.read(roles[role])
        return x.abs() if magnitude else x

    if bias:
        if "diff_b" not in roles:
            raise Unsupported("a bias delta other than LyCORIS diff_b")
        return t("diff_b"), 1
    if "diff" in roles:  # LyCORIS full: ΔW = diff
        return t("diff"), 1
    if "down" in roles and experts:  # PEFT target_parameters: ΔW[e] = scale · B_e @ A_e
        down, up = t("down"), t("up")
        r = down.shape[0] // experts
        scale = f.alpha_scale(roles, r)
        a_e = down.reshape(experts, r, down.shape[1])
        b_e = up.reshape(up.shape[0], r, experts).permute(2, 0, 1)
        return (abs(scale) if magnitude else scale) * torch.bmm(b_e, a_e), r
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


class FormulaReferee:
    """Every planned tensor with patches, recomputed from the adapter files by the published formulas."""

    def __init__(self, recipe, base: Path, adapters: list[Path], reason: str):
        specs = recipe.adapters
        loaded = [(load_adapter(path, allow_pickle=recipe.allow_pickle, lora_alpha=s.lora_alpha), s)
                  for path, s in zip(adapters, specs, strict=True)]  # fmt: skip
        checkpoint = open_base(base, allow_pickle=recipe.allow_pickle)
        self.plan, _, _ = plan_merge(recipe, checkpoint, loaded, [None] * len(loaded))
        if self.plan.task_merge is not None or getattr(recipe, "method", None) not in (None, "sum"):
            raise Unsupported(f"--method {recipe.method} has no published formula here")
        self.factors = [AdapterFactors(a, s.lora_alpha) for a, s in loaded]
        # each patch's adapter entry (a target_parameters LoRA offers candidates: the plan keeps one of them)
        self.owner = {id(p): ap for a, _ in loaded for ap in a.patches for p in (ap.patch, *(c for _, c in ap.either))}
        self.specs = specs
        self.info = RefereeInfo(
            REFERENCE,
            f"each changed tensor recomputed in float64 from the base and the adapter files' own factors by the "
            f"format's published formula, since {reason}",
            independent=False,
        )

    def expectations(self, only: set[str] | None = None) -> dict[str, Expectation]:
        """`only`: these output tensors alone (the rest of the file refereed by diffusers)."""
        out = {}
        for o in self.plan.outputs:
            if o.patches and (only is None or o.name in only):
                kinds = sorted({self._check(p) for p in o.patches})
                base_name = o.source.name if o.source is not None and o.source.name != o.name else None
                out[o.name] = Expectation(_module(o.name), ", ".join(kinds), self._rows(o), False, base_name,
                                          tuple(o.shape), added=o.source is None)  # fmt: skip
        return out

    @property
    def dropped(self) -> list[str]:
        """The base tensors the plan leaves out (a causal LM's head under the classifier made from it)."""
        return self.plan.task_head.dropped if self.plan.task_head else []

    def _check(self, p) -> str:
        """The patch's kind, or Unsupported now (before any tensor is read) when there is no formula for it."""
        inner = getattr(p.patch, "inner", p.patch)
        if type(inner).__name__ == "Replace":
            return "replacement"
        roles = self.factors[p.adapter].group(inner.sources[0])
        known = {"down", "diff", "diff_b", "hada_w1_a"} | {r for r in roles if r.startswith("lokr_")}
        if not known & set(roles):
            raise Unsupported(f"no published formula for a module with {', '.join(sorted(roles))}")
        return "DoRA" if {"dora", "magnitude"} & set(roles) else "delta"

    def _rows(self, o):
        def rows(w, start: int, end: int) -> Expected:
            ref, allowance = w.clone(), gamma(0) * w.abs()
            for p in o.patches:
                ref, allowance = self._apply(o, p, w, ref, allowance)
            return Expected(ref, allowance)

        return rows

    def _apply(self, o, p, w, ref, allowance):
        """One patch onto the running reference (and its float32 allowance)."""
        inner = getattr(p.patch, "inner", p.patch)
        f = self.factors[p.adapter]
        if type(inner).__name__ == "Replace":
            value = f.read(inner.sources[0])
            shape = ref.shape if o.source is not None else tuple(o.shape)  # a head the base lacks: from nothing
            return value.reshape(shape).clone(), value.new_zeros(shape)
        ap = self.owner[id(inner)]
        weight = self.specs[p.adapter].weight_for(o.name.split("/", 1)[0] if "/" in o.name else ap.component)
        roles = f.group(inner.sources[0])
        experts = getattr(inner, "experts", 0)
        lycoris = "dora" in roles
        w_delta = 1.0 if lycoris else weight  # LyCORIS DoRA: the weight interpolates the factor instead
        d, n = delta(f, roles, ap.param == "bias", experts=experts)
        a, _ = delta(f, roles, ap.param == "bias", magnitude=True, experts=experts)
        d, a = _placed(p, d), _placed(p, a)
        index = _index(p)
        shape = ref[index].shape
        if d.numel() != math.prod(shape):
            raise Unsupported(f"{inner.sources[0]}: shape {list(d.shape)} onto {list(shape)}")
        d, a = w_delta * d.reshape(shape), abs(w_delta) * a.reshape(shape)
        if {"dora", "magnitude"} & set(roles):
            return _dora(f, roles, p, w[index], ref, allowance, index, (d, a, n), weight if lycoris else 1.0)
        ref[index] += d
        allowance[index] += gamma(n) * a
        return ref, allowance


def _placed(p, d):
    """The part of a module's ΔW that lands on this tensor: an expert's slice, rows of a fused module, as stored."""
    inner = getattr(p.patch, "inner", p.patch)
    if p.patch is not inner:  # rows of a fused module (or of one expert of fused experts) on a separate tensor
        d = d[p.patch.expert] if getattr(p.patch, "expert", None) is not None else d
        d = d[p.patch.start : p.patch.end]
    return d.T if p.transposed else d


def _index(p) -> tuple:
    return (() if p.expert is None else (p.expert,)) + (() if p.rows is None else (slice(*p.rows),))


def _dora(f, roles, p, w0, ref, allowance, index, terms, interpolate: float):
    """DoRA: W' = (W + ΔW) · m / ‖W₀ + ΔW‖ along the magnitude's axis (LyCORIS dora_scale: the axis its shape
    says, the merge weight interpolating the factor, m·(f - 1) + 1; PEFT's magnitude: per output row)."""
    d, a, n = terms
    magnitude = f.read(roles.get("dora") or roles["magnitude"])
    shape = w0.shape
    per_input = "dora" in roles and magnitude.dim() >= 2 and magnitude.shape[0] == 1 and shape[0] != 1
    axis = 1 if per_input else 0
    if p.transposed and w0.dim() == 2:
        axis = 1 - axis
    reduce = [i for i in range(w0.dim()) if i != axis]
    norm = (w0 + d).norm(dim=reduce, keepdim=True)
    factor = magnitude.reshape(norm.shape) / norm
    if "dora" in roles and interpolate != 1.0:
        factor = interpolate * (factor - 1) + 1
    ref[index] = (ref[index] + d) * factor
    allowance[index] = (allowance[index] + gamma(n) * a) * factor.abs() + gamma(math.prod(shape) // max(
        shape[axis], 1) // 2) * ref[index].abs()  # fmt: skip
    return ref, allowance


def _module(name: str) -> str:
    return name.replace("/", ".").removesuffix(".weight").removesuffix(".bias")
