"""The merge math, once. Every adapter format becomes these patches; every front end applies them.

A patch transforms one float32 tensor in its storage layout. `transposed` says the tensor is stored
(in, out) rather than (out, in): GPT-2's Conv1D, or an embedding seen as a linear map from tokens to vectors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from converter.io.lazy import torch


class TensorSource(Protocol):
    def shape(self, name: str) -> tuple[int, ...]: ...
    def read(self, name: str) -> torch.Tensor: ...


@dataclass(frozen=True)
class Ref:
    """A tensor inside an adapter file, loaded only when its patch is applied."""

    source: TensorSource = field(repr=False, compare=False)
    name: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape(self.name)

    def load(self) -> torch.Tensor:
        return self.source.read(self.name).to(torch.float32)


class Patch:
    """Base class: `apply` returns the new float32 tensor; `sources` are the adapter tensors it consumes."""

    weight: float = 1.0
    # Whether an adapter's weight scales this patch; full replacements are taken as trained.
    weighted = True
    # Whether the result depends on the tensor before any delta (then the engine keeps a copy of it).
    reads_base = False

    @property
    def sources(self) -> tuple[str, ...]:
        raise NotImplementedError

    def set_weight(self, weight: float) -> None:
        if self.weighted:
            self.weight = weight

    def target_shape(self, transposed: bool) -> tuple[int, ...] | None:
        """The shape the target tensor must have, or None when any shape is accepted."""
        return None

    def fits(self, target: tuple[int, ...], transposed: bool) -> bool:
        """Whether this patch can apply to a tensor of shape `target`."""
        expected = self.target_shape(transposed)
        return expected is None or tuple(expected) == tuple(target)

    def apply(self, w: torch.Tensor, transposed: bool, base: torch.Tensor | None = None) -> torch.Tensor:
        """Return the patched tensor (may modify `w` in place). `base` is the tensor before any delta of any
        adapter: contributions that depend on the weight (DoRA) are taken relative to it, as PEFT's forward does."""
        raise NotImplementedError


def _lowrank_delta(up: torch.Tensor, down: torch.Tensor, mid: torch.Tensor | None) -> torch.Tensor:
    """up @ down for linear, 1x1 and kxk (2-D or 3-D) convolutions, with an optional Tucker core.

    kohya/LyCORIS conv LoRA (docs/FORMATS.md §1, §3): down (r, in, *k), up (out, r, 1, ..);
    ΔW = mm(up.flatten(1), down.flatten(1)).reshape(out, in, *k), which equals sd-scripts'
    conv2d(down.permute(1,0,..), up).permute(1,0,..). Tucker (`lora_mid`, LyCORIS rebuild_tucker):
    down (r, in, 1, 1), mid (r, r, *k), up (out, r, 1, 1): einsum("i j ..., i p, j r -> p r ...").
    """
    if mid is not None:
        return torch.einsum("ij...,ip,jr->pr...", mid, up.flatten(1).T, down.flatten(1))
    if down.dim() == 2:
        return up.flatten(1) @ down
    return (up.flatten(1) @ down.flatten(1)).reshape(up.shape[0], down.shape[1], *down.shape[2:])


class DeltaPatch(Patch):
    """A patch that adds a delta ΔW of a fixed natural (out, in, ...) shape: LoRA, LoHa, LoKr, full diff."""

    flip: bool = False

    def natural_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def raw_delta(self) -> torch.Tensor:
        """ΔW in float32 with the adapter's own scale, without the merge weight, natural layout."""
        raise NotImplementedError

    def target_shape(self, transposed: bool) -> tuple[int, ...]:
        shape = self.natural_shape()
        return (shape[1], shape[0]) if (transposed != self.flip) and len(shape) == 2 else shape

    def fits(self, target: tuple[int, ...], transposed: bool) -> bool:
        """Exact shape, or the same numbers laid out differently: a 1x1-conv delta on a linear weight (SD2's
        proj_in; kohya squeezes, §1) or a flattened (out, in·k·k) LoHa/LoKr delta on a conv kernel (§3)."""
        expected = tuple(self.target_shape(transposed))
        target = tuple(target)
        if expected == target:
            return True
        if not expected or not target or expected[0] != target[0] or math.prod(expected) != math.prod(target):
            return False
        squeeze = lambda s: tuple(d for i, d in enumerate(s) if i < 2 or d != 1)  # noqa: E731
        return squeeze(expected) == squeeze(target) or len(expected) == 2

    def delta(self, transposed: bool) -> torch.Tensor:
        """ΔW in float32, scaled by the adapter and the merge weight, in the target's storage layout."""
        d = self.raw_delta()
        if self.weight != 1.0:
            d.mul_(self.weight)
        return d.T if (transposed != self.flip) and d.dim() == 2 else d

    def apply(self, w: torch.Tensor, transposed: bool, base: torch.Tensor | None = None) -> torch.Tensor:
        return w.add_(self.delta(transposed).reshape(w.shape))


@dataclass
class LowRank(DeltaPatch):
    """ΔW = scale · up @ down (LoRA, LoCon; conv kxk and Tucker `mid` included).

    `flip` marks a delta computed as (out, in) that must be transposed to meet an (in, out) stored tensor
    independently of the storage layout (PEFT's embedding LoRA stores B@A as (dim, vocab)).
    `alpha` is the value the file stored (None: none stored), kept so a writer can reproduce the file.
    """

    down: Ref
    up: Ref
    scale: float
    flip: bool = False
    weight: float = 1.0
    mid: Ref | None = None
    alpha: float | None = None

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.down.name, self.up.name) + ((self.mid.name,) if self.mid is not None else ())

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def natural_shape(self) -> tuple[int, ...]:
        out, inp = self.up.shape[0], self.down.shape[1]
        if self.mid is not None:
            return (out, inp, *self.mid.shape[2:])
        return (out, inp, *self.down.shape[2:]) if len(self.down.shape) > 2 else (out, inp)

    def raw_delta(self) -> torch.Tensor:
        mid = self.mid.load() if self.mid is not None else None
        return _lowrank_delta(self.up.load(), self.down.load(), mid).mul_(self.scale)

    def apply(self, w: torch.Tensor, transposed: bool, base: torch.Tensor | None = None) -> torch.Tensor:
        if len(self.down.shape) == 2 and len(self.up.shape) == 2 and w.dim() == 2:
            # One fused kernel, no (out, in) temporary: W + s·B@A (into the transposed view when stored (in, out))
            view = w.T if transposed != self.flip else w
            view.addmm_(self.up.load(), self.down.load(), alpha=self.scale * self.weight)
            return w
        return super().apply(w, transposed, base)


def _tucker(t: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """LyCORIS rebuild_tucker: einsum("i j ..., j r, i p -> p r ...", t, wb, wa); wa (r, out), wb (r, in)."""
    return torch.einsum("ij...,jr,ip->pr...", t, wb.flatten(1), wa.flatten(1))


@dataclass
class LoHa(DeltaPatch):
    """LyCORIS LoHa: ΔW = scale · (w1a @ w1b) ⊙ (w2a @ w2b), reshaped to W (docs/FORMATS.md §3).

    With Tucker cores t1/t2 (conv kxk) each factor is rebuild_tucker(t, wa, wb) and wa is (r, out).
    scale = alpha / rank, rank = w1b.shape[0] (alpha absent: rank, so scale 1).
    """

    w1a: Ref
    w1b: Ref
    w2a: Ref
    w2b: Ref
    scale: float
    shape: tuple[int, ...]  # the target's natural shape (out, in, *k): the flattened product is reshaped to it
    t1: Ref | None = None
    t2: Ref | None = None
    alpha: float | None = None
    weight: float = 1.0

    @property
    def sources(self) -> tuple[str, ...]:
        refs = (self.w1a, self.w1b, self.w2a, self.w2b, self.t1, self.t2)
        return tuple(r.name for r in refs if r is not None)

    @property
    def rank(self) -> int:
        return self.w1b.shape[0]

    def natural_shape(self) -> tuple[int, ...]:
        return self.shape

    def raw_delta(self) -> torch.Tensor:
        if self.t1 is not None and self.t2 is not None:
            m1 = _tucker(self.t1.load(), self.w1a.load(), self.w1b.load())
            m2 = _tucker(self.t2.load(), self.w2a.load(), self.w2b.load())
        else:
            m1 = self.w1a.load() @ self.w1b.load().flatten(1)
            m2 = self.w2a.load() @ self.w2b.load().flatten(1)
        return (m1 * m2).reshape(self.shape).mul_(self.scale)


@dataclass
class LoKr(DeltaPatch):
    """LyCORIS LoKr: ΔW = scale · kron(w1, w2), reshaped to W (docs/FORMATS.md §3).

    Each factor is full (`lokr_w1`) or low rank (`lokr_w1_a @ lokr_w1_b`); w2 may have a Tucker core t2.
    The scale rule is the caller's (LyCORIS: 1 when both factors are full, else alpha/rank).
    """

    w1: Ref | tuple[Ref, Ref]
    w2: Ref | tuple[Ref, Ref]
    scale: float
    shape: tuple[int, ...]
    t2: Ref | None = None
    alpha: float | None = None
    weight: float = 1.0

    @property
    def sources(self) -> tuple[str, ...]:
        out = []
        for f in (self.w1, self.w2, self.t2):
            if isinstance(f, tuple):
                out.extend(r.name for r in f)
            elif f is not None:
                out.append(f.name)
        return tuple(out)

    def natural_shape(self) -> tuple[int, ...]:
        return self.shape

    def raw_delta(self) -> torch.Tensor:
        w1 = self.w1.load() if isinstance(self.w1, Ref) else self.w1[0].load() @ self.w1[1].load()
        if isinstance(self.w2, Ref):
            w2 = self.w2.load()
        elif self.t2 is not None:
            w2 = _tucker(self.t2.load(), self.w2[0].load(), self.w2[1].load())
        else:
            w2 = self.w2[0].load() @ self.w2[1].load().flatten(1)
        while w1.dim() < w2.dim():
            w1 = w1.unsqueeze(-1)
        return torch.kron(w1, w2).reshape(self.shape).mul_(self.scale)


def expert_factors(a: torch.Tensor, b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B_e (E, out, r), A_e (E, r, in)) of a PEFT `target_parameters` LoRA on a fused 3-D expert tensor:
    A (r·E, in) holds expert e's r rows as one block (expert-major), B (out, r·E) interleaves the experts'
    columns with the expert index fastest (column j·E + e is expert e's j-th); docs/FORMATS.md §10. Established
    against PEFT's forward in the tests; reading A rank-major instead (Unsloth's bug) hands every expert another's
    delta."""
    r = a.shape[0] // experts
    return b.reshape(b.shape[0], r, experts).permute(2, 0, 1), a.reshape(experts, r, a.shape[1])


def expert_delta(a: torch.Tensor, b: torch.Tensor, experts: int) -> torch.Tensor:
    """ΔW (E, out, in), unscaled, of a LoRA on fused experts (layout: `expert_factors`)."""
    return torch.bmm(*expert_factors(a, b, experts))


@dataclass
class ExpertLowRank(DeltaPatch):
    """A PEFT `target_parameters` LoRA on a fused expert tensor (E, out, in): ΔW[e] = scale · B_e @ A_e with the
    layout of `expert_delta`. No DoRA, bias or fan_in_fan_out exist for these in PEFT 0.21."""

    down: Ref
    up: Ref
    scale: float
    experts: int
    weight: float = 1.0

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.down.name, self.up.name)

    @property
    def rank(self) -> int:
        return self.down.shape[0] // self.experts

    def natural_shape(self) -> tuple[int, ...]:
        return (self.experts, self.up.shape[0], self.down.shape[1])

    def target_shape(self, transposed: bool) -> tuple[int, ...]:
        """(E, out, in), or (E, in, out) where the base stores experts transposed (GPT-OSS; its keymap says)."""
        experts, out, inp = self.natural_shape()
        return (experts, inp, out) if transposed else (experts, out, inp)

    def fits(self, target: tuple[int, ...], transposed: bool) -> bool:
        return tuple(target) == self.target_shape(transposed)

    def delta(self, transposed: bool) -> torch.Tensor:
        d = self.raw_delta()
        if self.weight != 1.0:
            d.mul_(self.weight)
        return d.transpose(1, 2) if transposed else d

    def raw_delta(self) -> torch.Tensor:
        return expert_delta(self.down.load(), self.up.load(), self.experts).mul_(self.scale)

    def expert_rows(self, expert: int, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of one expert's ΔW, scaled and weighted: only that expert's factors multiplied. A base
        that stores experts apart asks once per expert and part, so the factors of the last two patches (gate_up
        and down interleave in file order) stay loaded instead of being read again each time."""
        cached = _FACTORS.pop(id(self), None)
        if cached is None or cached[0] is not self:
            cached = (self, expert_factors(self.down.load(), self.up.load(), self.experts))
        _FACTORS[id(self)] = cached
        while len(_FACTORS) > 2:
            _FACTORS.pop(next(iter(_FACTORS)))
        up, down = cached[1]
        return (up[expert, start:end] @ down[expert]).mul_(self.scale * self.weight)


_FACTORS: dict[int, tuple[ExpertLowRank, tuple[torch.Tensor, torch.Tensor]]] = {}  # most recently used last


@dataclass
class FullDelta(DeltaPatch):
    """LyCORIS full (`diff`): ΔW stored whole, no alpha (docs/FORMATS.md §3); the merge weight scales it."""

    diff: Ref
    weight: float = 1.0

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.diff.name,)

    def natural_shape(self) -> tuple[int, ...]:
        return self.diff.shape

    def target_shape(self, transposed: bool) -> tuple[int, ...]:
        return self.diff.shape

    def raw_delta(self) -> torch.Tensor:
        return self.diff.load().clone()

    def delta(self, transposed: bool) -> torch.Tensor:
        d = self.raw_delta()
        return d.mul_(self.weight) if self.weight != 1.0 else d


@dataclass
class DoRA(Patch):
    """DoRA: W' = f ⊙ (W + ΔW), f = m / ‖W₀ + ΔW‖ per output channel (norm over everything else).

    W₀ is the tensor before any adapter's delta. With one adapter W = W₀ and this is PEFT's merge; with several,
    each applies in order to the running W while its norm uses W₀, which is what PEFT 0.21 does both in its
    unmerged forward (DoRA rescales the running result) and in merge_and_unload. The adapter weight scales ΔW
    (PEFT's `set_scale`); the magnitude vector is used as trained.

    LyCORIS/kohya `dora_scale` (style "lycoris", docs/FORMATS.md §3 DoRA): the axis is told by its shape,
    (out, 1, ..) per output channel or (1, in, ..) per input column (files before 2025-04); the merge weight m
    interpolates the factor instead of scaling ΔW: f' = m·(f - 1) + 1, with ΔW unweighted.
    """

    lora: DeltaPatch
    magnitude: Ref
    style: str = "peft"
    reads_base = True

    def set_weight(self, weight: float) -> None:
        self.lora.set_weight(weight)

    @property
    def sources(self) -> tuple[str, ...]:
        return (*self.lora.sources, self.magnitude.name)

    def target_shape(self, transposed: bool) -> tuple[int, ...]:
        return self.lora.target_shape(transposed)

    def fits(self, target: tuple[int, ...], transposed: bool) -> bool:
        return self.lora.fits(target, transposed)

    def axis(self, transposed: bool, w_shape: tuple[int, ...]) -> int:
        """The axis the magnitude runs along, in storage layout."""
        out_axis = 1 if (transposed != self.lora.flip) and len(w_shape) == 2 else 0
        if self.style == "peft":
            return out_axis
        m = self.magnitude.shape
        if len(m) >= 2 and m[0] == 1 and w_shape[out_axis] != 1:
            return 1 - out_axis if len(w_shape) == 2 else 1  # the input axis (old LyCORIS/OneTrainer files)
        return out_axis

    def per_output_row(self) -> bool:
        """Whether the magnitude runs along the output rows (PEFT's; LyCORIS' (out, 1, ..)): then each row of the
        result depends on that row alone, and a fused module's rows can land on separate tensors (`DoRARows`)."""
        m = self.magnitude.shape
        return self.style == "peft" or not (len(m) >= 2 and m[0] == 1)

    def apply(self, w: torch.Tensor, transposed: bool, base: torch.Tensor | None = None) -> torch.Tensor:
        return self.apply_rows(w, transposed, base, None)

    def apply_rows(
        self, w: torch.Tensor, transposed: bool, base: torch.Tensor | None, rows: tuple[int, int] | None
    ) -> torch.Tensor:
        """`apply`, or with `rows`, rows [start, end) of the fused result (output-row magnitudes only)."""
        base = w if base is None else base
        weight = self.lora.weight
        if self.style == "lycoris":
            self.lora.weight = 1.0
        try:
            delta = self.lora.delta(transposed if rows is None else False)
        finally:
            self.lora.weight = weight
        magnitude = self.magnitude.load()
        if rows is not None:
            delta, magnitude = delta[rows[0] : rows[1]], magnitude.reshape(-1)[rows[0] : rows[1]]
        delta = delta.reshape(w.shape)
        axis = 0 if rows is not None else self.axis(transposed, tuple(w.shape))
        reduce = [d for d in range(w.dim()) if d != axis]
        norm = torch.linalg.vector_norm(base + delta, dim=reduce, keepdim=True)
        factor = magnitude.reshape(norm.shape) / norm
        if self.style == "lycoris" and weight != 1.0:
            factor = weight * (factor - 1) + 1
        return w.add_(delta).mul_(factor)


@dataclass
class DoRARows(Patch):
    """Rows [start, end) of a DoRA on a fused module (ai-toolkit's DoRA on BFL's `img_attn.qkv`) landing on a
    separate base tensor (diffusers' to_q / to_k / to_v). With the magnitude along the output rows, the norm is
    taken per row, so the rows of the fused result are exactly these rows' own: W'[r] = m[r] · (W + ΔW)[r] / ‖·‖."""

    inner: DoRA
    start: int
    end: int
    reads_base = True

    @property
    def sources(self) -> tuple[str, ...]:
        return ()  # accounted for once, by the adapter patch itself

    def set_weight(self, weight: float) -> None:
        self.inner.set_weight(weight)

    def target_shape(self, transposed: bool) -> tuple[int, ...]:
        return (self.end - self.start, *tuple(self.inner.target_shape(False))[1:])

    def apply(self, w: torch.Tensor, transposed: bool, base: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.apply_rows(w, False, base, (self.start, self.end))


def rows_of(patch: Patch, start: int, end: int, expert: int | None = None) -> Patch:
    """Rows [start, end) of a fused module's patch, for a base that keeps those rows as their own tensor."""
    if isinstance(patch, DoRA) and expert is None:
        return DoRARows(patch, start, end)
    return RowsOf(patch, start, end, expert)  # type: ignore[arg-type]


@dataclass
class RowsOf(Patch):
    """Rows [start, end) of another patch's delta: a fused adapter module (kohya's BFL `img_attn.qkv`, linear1)
    landing on separate base tensors (diffusers to_q / to_k / to_v / proj_mlp). For a LoRA that is
    up[start:end] @ down, exactly the split diffusers itself makes (docs/FORMATS.md §4 _convert_to_ai_toolkit_cat).
    With `expert`, the rows of that expert's slice of a fused expert delta (E, out, in): a LoRA on fused MoE
    experts landing on a base that stores each expert's gate / up / down as its own tensor."""

    inner: DeltaPatch
    start: int
    end: int
    expert: int | None = None

    @property
    def sources(self) -> tuple[str, ...]:
        return ()  # the inner patch's tensors are accounted for once, by the adapter patch itself

    def set_weight(self, weight: float) -> None:
        self.inner.set_weight(weight)

    def target_shape(self, transposed: bool) -> tuple[int, ...]:
        shape = tuple(self.inner.target_shape(False))
        if self.expert is not None:
            shape = shape[1:]
        return (self.end - self.start, *shape[1:])

    def apply(self, w: torch.Tensor, transposed: bool, base: torch.Tensor | None = None) -> torch.Tensor:
        inner = self.inner
        if self.expert is not None:
            return w.add_(inner.expert_rows(self.expert, self.start, self.end).reshape(w.shape))
        if isinstance(inner, LowRank) and inner.mid is None and len(inner.down.shape) == 2 and w.dim() == 2:
            up = inner.up.load()[self.start : self.end]
            return w.addmm_(up, inner.down.load(), alpha=inner.scale * inner.weight)
        return w.add_(inner.delta(False)[self.start : self.end].reshape(w.shape))


@dataclass
class BiasDelta(Patch):
    """b' = b + scale · Δb (PEFT's `lora_B.bias` with lora_bias=True; LyCORIS `diff_b`, scale 1)."""

    delta: Ref
    scale: float
    weight: float = 1.0

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.delta.name,)

    def target_shape(self, transposed: bool) -> tuple[int, ...]:
        return self.delta.shape

    def apply(self, w: torch.Tensor, transposed: bool, base: torch.Tensor | None = None) -> torch.Tensor:
        return w.add_(self.delta.load(), alpha=self.scale * self.weight)


@dataclass
class Replace(Patch):
    """The adapter carries the whole tensor (PEFT modules_to_save, saved base layers); it may be resized."""

    value: Ref
    # Copies of the same tensor that PEFT also saves (modules_to_save / original_module): accounted, not used.
    duplicates: tuple[str, ...] = ()
    weighted = False

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.value.name, *self.duplicates)

    def apply(self, w: torch.Tensor, transposed: bool, base: torch.Tensor | None = None) -> torch.Tensor:
        return self.value.load()


@dataclass
class RowReplace(Patch):
    """Rows `indices` of an embedding replaced by the trained rows (PEFT trainable_token_indices)."""

    rows: Ref
    indices: tuple[int, ...]
    weighted = False

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.rows.name,)

    def apply(self, w: torch.Tensor, transposed: bool, base: torch.Tensor | None = None) -> torch.Tensor:
        index = torch.tensor(self.indices, dtype=torch.long)
        return w.index_copy_(0, index, self.rows.load())


@dataclass
class Requantize(Patch):
    """W → dequantize(quantize_4bit(W)): the base weight as a QLoRA adapter saw it during training
    (bitsandbytes NF4/FP4, the same block size and double quantization as transformers' load_in_4bit)."""

    quant_type: str = "nf4"
    blocksize: int = 64
    double_quant: bool = True
    weighted = False

    @property
    def sources(self) -> tuple[str, ...]:
        return ()

    def apply(self, w: torch.Tensor, transposed: bool, base: torch.Tensor | None = None) -> torch.Tensor:
        import bitsandbytes.functional as bnb

        packed, state = bnb.quantize_4bit(
            w, quant_type=self.quant_type, blocksize=self.blocksize, compress_statistics=self.double_quant
        )
        return bnb.dequantize_4bit(packed, state).to(torch.float32)


def lora_scale(alpha: float, rank: int, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf, in one cheap pass (aminmax propagates NaN; isfinite().all() builds a boolean tensor first)."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))
