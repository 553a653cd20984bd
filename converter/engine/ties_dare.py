"""TIES, DARE and magnitude pruning on one tensor at a time, with the semantics of PEFT's merge utilities.

- magnitude pruning keeps the k = ⌊density · numel⌋ largest |values| (density >= 1 keeps everything);
- DARE keeps each value with probability `density` and divides the survivors by it;
- TIES elects a sign per element from the (pruned, unweighted) task tensors ("total": the sign of their sum,
  "frequency": the sign most of them have; zero counts as +), then averages the weighted values that agree.

DARE's random masks come from a generator seeded by (seed, module, side, adapter index), so a module's mask does
not depend on which other modules exist or the order they are visited in: streaming gives the same result as a
whole-model pass, and a run is reproduced by its seed. (PEFT draws from torch's global generator in model order,
after its own adapter initialisation used it, so the same seed gives PEFT different masks; tests/methods/test_combine.py
checks that, given our masks, PEFT's result is ours.)
"""

from __future__ import annotations

import hashlib
import struct

from converter.io.lazy import torch


def magnitude_prune(t: torch.Tensor, density: float) -> torch.Tensor:
    if density >= 1:
        return t
    k = int(density * t.numel())
    flat = t.reshape(-1)
    mask = torch.zeros_like(flat)
    mask[torch.topk(flat.abs(), k=k, largest=True).indices] = 1
    return t * mask.reshape(t.shape)


def dare_mask(shape: tuple[int, ...], density: float, seed: int, *where: object) -> torch.Tensor:
    """The keep-mask (0/1, float32) DARE uses for one tensor, a pure function of the seed and `where`."""
    key = ":".join(str(w) for w in (seed, *where)).encode()
    g = torch.Generator().manual_seed(struct.unpack("<Q", hashlib.sha256(key).digest()[:8])[0] >> 1)
    return torch.bernoulli(torch.full(shape, float(density), dtype=torch.float32), generator=g)


def dare_prune(t: torch.Tensor, density: float, mask: torch.Tensor) -> torch.Tensor:
    if density >= 1:
        return t
    return t * mask.to(t.dtype) / density


def sign_mask(stacked: torch.Tensor, method: str = "total") -> torch.Tensor:
    """Which entries of each task tensor (stacked on dim 0) agree with the elected sign."""
    sign = stacked.sign()
    votes = stacked.sum(0) if method == "total" else sign.sum(0)
    elected = torch.where(votes >= 0, 1.0, -1.0).to(stacked.dtype)
    return sign == elected


def combine_tensors(
    tensors: list[torch.Tensor],
    weights: list[float],
    method: str,
    density: float | None = None,
    masks: list[torch.Tensor] | None = None,
    sign_method: str = "total",
) -> torch.Tensor:
    """One merged tensor from task tensors of the same shape. `method`: linear, ties, dare_linear, dare_ties,
    magnitude_prune; `masks`: DARE's keep-masks, one per tensor."""
    if method in ("ties", "magnitude_prune"):
        tensors = [magnitude_prune(t, density) for t in tensors]
    elif method in ("dare_linear", "dare_ties"):
        tensors = [dare_prune(t, density, m) for t, m in zip(tensors, masks, strict=True)]
    stacked = torch.stack(tensors)
    w = torch.tensor(weights, dtype=stacked.dtype).reshape(-1, *([1] * (stacked.dim() - 1)))
    if method in ("ties", "dare_ties"):
        agree = sign_mask(stacked, sign_method)
        weighted = stacked * w
        return (weighted * agree).sum(0) / agree.sum(0).clamp(min=1).to(stacked.dtype)
    return (stacked * w).sum(0)
