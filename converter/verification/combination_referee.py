"""The referee of a TIES / DARE / magnitude-pruning merge: PEFT's own rules on PEFT's own deltas.

Per module, each adapter's ΔW is PEFT's `get_delta_weight` (float64, on the weightless model of peft_referee),
and they are combined by PEFT's `merge_utils` (`ties`, `dare_linear`, `dare_ties`, `magnitude_prune`) with the
recipe's weights and density: exactly what `add_weighted_adapter` does for its `*_svd` combination types before
their SVD. DARE's random masks are the ones the merge drew: a pure function of the recorded seed, the tensor's
name and the adapter's index (converter.engine.ties_dare.dare_mask), handed to PEFT in the order it draws them.

These rules have thresholds (the k-th largest |ΔW| kept, the sign a sum elects), so float32 arithmetic may take
the other side of one where the exact values sit within its error of it. Such elements are allowed either
outcome (at most twice the largest weighted value there); every other element is held to rounding as usual.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

from converter.engine.recipe import Recipe
from converter.engine.ties_dare import dare_mask
from converter.verification.peft_referee import PREFIX, PeftLayers, _adapters_in, _allowance, hollow_peft_model
from converter.verification.peft_referee import _tied_sources as tied_sources
from converter.verification.referee import Expectation, Expected, RefereeInfo, RefereeUnavailable

# --method of the merge -> PEFT's merge_utils function
PEFT_RULE = {"ties": "ties", "dare": "dare_linear", "dare_ties": "dare_ties", "magnitude_prune": "magnitude_prune"}


class CombinationReferee:
    """PEFT's combination of the adapters' deltas, per tensor, added to the base."""

    def __init__(self, base: Path, adapters: list[Path], recipe: Recipe, base_names: set[str], vocab: int | None):
        if recipe.method not in PEFT_RULE:
            raise RefereeUnavailable(f"PEFT has no combination rule for --method {recipe.method}")
        self.recipe, self.rule = recipe, PEFT_RULE[recipe.method]
        self.names = [f"adapter{i}" for i in range(len(adapters))]
        self.model = hollow_peft_model(Path(base), [Path(a) for a in adapters], self.names, vocab)
        self.layers = PeftLayers(self.model, PREFIX, "", self.names, recipe.adapters, base_names,
                                 tied_sources(self.model), saved=self.model.saved_names)  # fmt: skip
        self.info = RefereeInfo(
            "PEFT",
            f"PEFT's {self.rule} (merge_utils, as add_weighted_adapter combines {self.rule}_svd before its SVD) of "
            f"each adapter's get_delta_weight, density {recipe.density}"
            + (f", DARE masks from seed {recipe.seed or 0} as the merge drew them" if "dare" in self.rule else ""),
        )

    def expectations(self) -> dict[str, Expectation]:
        out = {}
        for name, rule in self.layers.expectations().items():
            if rule.kind != "LoRA":
                raise RefereeUnavailable(f"--method {self.recipe.method} merges plain LoRA deltas only, not the "
                                         f"{rule.kind} of {rule.module}")  # fmt: skip
            layer = self.model.get_submodule(rule.module)
            adapters = self.layers._admitted(layer, name)
            out[name] = Expectation(rule.module, self.rule.replace("_", " "), self._rows(name, layer, adapters),
                                    False, rule.base_name)  # fmt: skip
        return out

    def _rows(self, name: str, layer, adapters: list[str]):
        import torch
        from peft.utils import merge_utils

        density = float(self.recipe.density)
        weights = [self.recipe.adapters[self.names.index(n)].weight_for(None) for n in adapters]

        def rows(base, start: int, end: int) -> Expected:
            _adapters_in(layer, base.dtype)
            deltas = [layer.get_delta_weight(n).to(base.dtype) for n in adapters]
            with _DRAWING:  # dare_mask draws with torch.bernoulli too: never while another tensor's is replaced
                masks = [self._mask(name, n, deltas[0].shape, density) for n in adapters] if "dare" in self.rule else []
            args = (deltas, torch.tensor(weights, dtype=base.dtype), density)
            extra = () if self.rule in ("magnitude_prune", "dare_linear") else ("total",)
            with _given_masks(masks):
                combined = getattr(merge_utils, self.rule)(*args, *extra)
            every = torch.arange(deltas[0].numel())
            noise = [2 * _allowance(layer, [n], d)(every).reshape(d.shape)
                     for d, n in zip(deltas, adapters, strict=True)]  # fmt: skip
            return Expected(base + combined, _allowance_of(self.rule, deltas, weights, noise, density, masks))

        return rows

    def _mask(self, name: str, adapter: str, shape, density: float):
        return dare_mask(tuple(shape), density, int(self.recipe.seed or 0), name, "delta", self.names.index(adapter))


# torch.bernoulli is replaced process-wide while PEFT draws, and the masks are drawn with it: one tensor at a time
_DRAWING = threading.Lock()


@contextmanager
def _given_masks(masks: list):
    """PEFT's DARE draws each task tensor's mask with torch.bernoulli, in task order: hand it these instead."""
    import torch

    if not masks:
        yield
        return
    with _DRAWING, _replaced_bernoulli(torch, list(masks)):
        yield


@contextmanager
def _replaced_bernoulli(torch, queue: list):
    original = torch.bernoulli

    def drawn(p, *args, **kwargs):
        mask = queue.pop(0)
        if tuple(mask.shape) != tuple(p.shape):
            raise RefereeUnavailable("PEFT drew a DARE mask of another shape than the merge's")
        return mask.to(p.dtype)

    torch.bernoulli = drawn
    try:
        yield
    finally:
        torch.bernoulli = original


def _allowance_of(rule: str, deltas: list, weights: list[float], noise: list, density: float, masks: list):
    """float32's error on the continuous part (each |w|·ΔW's own, over the density for DARE), and, where a
    threshold or a sign vote is within that error, room for either outcome."""
    import torch

    scale = 1.0 / density if rule.startswith("dare") else 1.0
    total = sum(abs(w) * scale * n for w, n in zip(weights, noise, strict=True))
    ambiguous = torch.zeros(deltas[0].shape, dtype=torch.bool)
    kept = [m.to(d.dtype) * d * scale for m, d in zip(masks, deltas, strict=True)] if masks else deltas
    if rule in ("ties", "magnitude_prune"):
        kept = []
        for d, n in zip(deltas, noise, strict=True):
            k = int(density * d.numel())
            threshold = d.abs().flatten().kthvalue(max(d.numel() - k + 1, 1)).values if 0 < k < d.numel() else None
            if threshold is not None:
                ambiguous |= (d.abs() - threshold).abs() <= n + n.max()
            kept.append(d * (d.abs() >= threshold) if threshold is not None else d)
    if rule in ("ties", "dare_ties"):
        votes = torch.stack(kept).sum(0)
        ambiguous |= votes.abs() <= sum(noise) * scale
    largest = torch.stack([abs(w) * scale * d.abs() for w, d in zip(weights, deltas, strict=True)]).amax(0)
    return total + 2 * largest * ambiguous
