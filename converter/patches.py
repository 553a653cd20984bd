"""The merge math, once. Every adapter format becomes these patches; every front end applies them.

A patch transforms one float32 tensor in its storage layout. `transposed` says the tensor is stored
(in, out) rather than (out, in): GPT-2's Conv1D, or an embedding seen as a linear map from tokens to vectors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F


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

    def apply(self, w: torch.Tensor, transposed: bool, base: torch.Tensor | None = None) -> torch.Tensor:
        """Return the patched tensor (may modify `w` in place). `base` is the tensor before any delta of any
        adapter: contributions that depend on the weight (DoRA) are taken relative to it, as PEFT's forward does."""
        raise NotImplementedError


@dataclass
class LowRank(Patch):
    """ΔW = scale · up @ down (LoRA, LoCon). For kxk convolutions, PEFT's/kohya's conv(downᵀ, up) composition.

    `flip` marks a delta computed as (out, in) that must be transposed to meet an (in, out) stored tensor
    independently of the storage layout (PEFT's embedding LoRA stores B@A as (dim, vocab)).
    """

    down: Ref
    up: Ref
    scale: float
    flip: bool = False
    weight: float = 1.0

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.down.name, self.up.name)

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def _natural_shape(self) -> tuple[int, ...]:
        out, inp = self.up.shape[0], self.down.shape[1]
        return (out, inp, *self.down.shape[2:]) if len(self.down.shape) == 4 else (out, inp)

    def target_shape(self, transposed: bool) -> tuple[int, ...]:
        shape = self._natural_shape()
        return (shape[1], shape[0]) if (transposed != self.flip) and len(shape) == 2 else shape

    def delta(self, transposed: bool) -> torch.Tensor:
        """ΔW in float32, scaled, in the target's storage layout."""
        down, up = self.down.load(), self.up.load()
        if down.dim() == 4:
            if down.shape[2:] == (1, 1):
                d = (up.flatten(1) @ down.flatten(1))[:, :, None, None]
            else:
                d = F.conv2d(down.transpose(0, 1), up).transpose(0, 1)
        else:
            d = up @ down
        d.mul_(self.scale * self.weight)
        return d.T if (transposed != self.flip) and d.dim() == 2 else d

    def apply(self, w: torch.Tensor, transposed: bool, base: torch.Tensor | None = None) -> torch.Tensor:
        if len(self.down.shape) == 2:
            # One fused kernel, no (out, in) temporary: W + s·B@A (into the transposed view when stored (in, out))
            view = w.T if transposed != self.flip else w
            view.addmm_(self.up.load(), self.down.load(), alpha=self.scale * self.weight)
            return w
        return w.add_(self.delta(transposed))


@dataclass
class DoRA(Patch):
    """DoRA: W' = f ⊙ (W + ΔW), f = m / ‖W₀ + ΔW‖ per output channel (norm over everything else).

    W₀ is the tensor before any adapter's delta. With one adapter W = W₀ and this is PEFT's merge; with several,
    each applies in order to the running W while its norm uses W₀, which is what PEFT 0.21 does both in its
    unmerged forward (DoRA rescales the running result) and in merge_and_unload. The adapter weight scales ΔW
    (PEFT's `set_scale`); the magnitude vector is used as trained.
    """

    lora: LowRank
    magnitude: Ref
    reads_base = True

    def set_weight(self, weight: float) -> None:
        self.lora.set_weight(weight)

    @property
    def sources(self) -> tuple[str, ...]:
        return (*self.lora.sources, self.magnitude.name)

    def target_shape(self, transposed: bool) -> tuple[int, ...]:
        return self.lora.target_shape(transposed)

    def apply(self, w: torch.Tensor, transposed: bool, base: torch.Tensor | None = None) -> torch.Tensor:
        base = w if base is None else base
        delta = self.lora.delta(transposed)
        out_axis = 1 if (transposed != self.lora.flip) and w.dim() == 2 else 0
        reduce = [d for d in range(w.dim()) if d != out_axis]
        norm = torch.linalg.vector_norm(base + delta, dim=reduce, keepdim=True)
        factor = self.magnitude.load().reshape(norm.shape) / norm
        return w.add_(delta).mul_(factor)


@dataclass
class BiasDelta(Patch):
    """b' = b + scale · Δb (PEFT's `lora_B.bias` with lora_bias=True; LyCORIS `diff_b`)."""

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
    """No NaN/Inf, in one cheap pass (aminmax propagates NaN; isfinite().all() is ~30x slower on CPU)."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))
