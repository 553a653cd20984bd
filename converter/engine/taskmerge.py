"""`converter merge --method ties|dare|dare_ties|magnitude_prune`: several adapters into a base by TIES or DARE
instead of a plain weighted sum, one output tensor at a time.

Each adapter's full delta on the tensor (its task vector ΔWᵢ: every patch of that adapter on it, rows of fused
tensors included, with the adapter's own scale) is formed in float32, then merged with the semantics of
converter.engine.ties_dare (PEFT's merge utilities): magnitude pruning or DARE drop-and-rescale at `density`, TIES
sign election on the pruned ΔWᵢ and the disjoint mean of the weighted ones, and added to the base tensor. DARE's
masks are seeded by (seed, tensor name, adapter index), so the result does not depend on tensor order or shards.
Only additive patches (LoRA, LoHa, LoKr, full deltas, bias deltas) take part; a replacement (modules_to_save) or
DoRA has no task vector and is refused. Memory: one float32 copy of the tensor per adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

from converter.engine.ties_dare import combine_tensors, dare_mask
from converter.errors import BadInputError, UsageError
from converter.formats.patches import BiasDelta, DeltaPatch, RowsOf
from converter.io.lazy import torch

# --method for `converter merge` -> the rule in converter.engine.ties_dare ("sum" is the ordinary merge)
MERGE_METHODS = {"ties": "ties", "dare": "dare_linear", "dare_ties": "dare_ties", "magnitude_prune": "magnitude_prune"}


@dataclass
class TaskMerge:
    method: str
    density: float
    seed: int = 0
    sign_method: str = "total"

    @classmethod
    def from_recipe(cls, recipe) -> TaskMerge | None:
        """None for an ordinary merge; else the checked settings (one-line errors before any tensor is read)."""
        method = getattr(recipe, "method", None)
        if method in (None, "sum"):
            if getattr(recipe, "density", None) is not None:
                raise UsageError("--density applies to --method ties|dare|dare_ties|magnitude_prune only")
            return None
        if method not in MERGE_METHODS:
            raise UsageError(f"--method {method}: choose sum, {', '.join(MERGE_METHODS)}")
        density = getattr(recipe, "density", None)
        if density is None or not 0 < density <= 1:
            raise UsageError(f"--method {method} needs --density, the fraction of each delta kept, in (0, 1]")
        return cls(MERGE_METHODS[method], float(density), int(getattr(recipe, "seed", None) or 0))

    def __call__(self, o, t: torch.Tensor) -> torch.Tensor:
        """The merged float32 tensor for output `o` (a plan.OutputTensor) from its base tensor `t`."""
        w = t.to(torch.float32, copy=True)
        tasks: dict[int, torch.Tensor] = {}
        weights: dict[int, float] = {}
        for p in o.patches:
            if not isinstance(p.patch, DeltaPatch | RowsOf | BiasDelta):
                raise BadInputError(
                    f"{o.name}: adapter {p.adapter + 1} has a {type(p.patch).__name__} patch here, which is not a "
                    f"delta; --method {self.method} merges deltas only (drop that adapter's modules_to_save/DoRA "
                    "with its exclude, or merge with the default sum)",
                    tensor=o.name,
                )
            task = tasks.setdefault(p.adapter, torch.zeros_like(w))
            index = (() if p.expert is None else (p.expert,)) + (() if p.rows is None else (slice(*p.rows),))
            weights[p.adapter] = _unweighted(p.patch, task[index], p.transposed)
        order = sorted(tasks)
        masks = None
        if self.method.startswith("dare"):
            masks = [dare_mask(tuple(w.shape), self.density, self.seed, o.name, "delta", i) for i in order]
        merged = combine_tensors([tasks[i] for i in order], [weights[i] for i in order], self.method, self.density,
                                 masks, self.sign_method)  # fmt: skip
        return w.add_(merged)


def _unweighted(patch, view: torch.Tensor, transposed: bool) -> float:
    """Add the patch's delta at merge weight 1 into `view`; return its merge weight."""
    inner = patch.inner if isinstance(patch, RowsOf) else patch
    weight = inner.weight
    patch.set_weight(1.0)
    try:
        patch.apply(view, transposed)
    finally:
        patch.set_weight(weight)
    return weight
