"""What extract, resize and combine are asked to do, as data: one frozen options object per verb, with its
defaults and its checks. The command line, the Python API and any other front end build these objects and hand
them over whole; each check fails in one line before an adapter or model is read. No torch here: the parser is
built for every command."""

from __future__ import annotations

from dataclasses import dataclass

from converter.conversion.options import TARGETS
from converter.errors import UsageError

FACTOR_METHODS = ("linear", "ties", "dare_linear", "dare_ties", "magnitude_prune")
SVD_METHODS = ("svd", "ties_svd", "dare_linear_svd", "dare_ties_svd", "magnitude_prune_svd")
METHODS = ("cat", *FACTOR_METHODS, *SVD_METHODS)
NEEDS_DENSITY = {"ties", "dare_linear", "dare_ties", "magnitude_prune"}
RANK_RULES = ("fixed", "sv_ratio", "sv_fro", "sv_cumulative", "sv_epsilon")


@dataclass(frozen=True, kw_only=True)
class Output:
    """How the adapter is written: `to` one of converter.conversion's TARGETS, `force` replaces an existing output,
    `allow_pickle` lets .bin inputs be read (weights only)."""

    to: str = "peft"
    force: bool = False
    allow_pickle: bool = False

    def __post_init__(self) -> None:
        if self.to not in TARGETS:
            raise UsageError(f"--to {self.to}: choose one of {', '.join(TARGETS)}")


@dataclass(frozen=True, kw_only=True)
class ExtractOptions(Output):
    """`extract`: the rank (the cap of a dynamic `rule`), which tensors (`include` / `exclude`: regexes), and
    whether tensors with no low-rank form (embeddings, norms, biases) are saved whole (`modules_to_save`)."""

    rank: int
    rule: str = "fixed"
    param: float | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    modules_to_save: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_rank(self.rank)
        check_rule(self.rule, self.param)
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "exclude", tuple(self.exclude))


@dataclass(frozen=True, kw_only=True)
class ResizeOptions(Output):
    """`resize`: the new rank (the cap of a dynamic `rule`); `base` / `component` name the model the adapter is
    for where its names need looking up (kohya's flattened names, a PEFT adapter of one pipeline part)."""

    rank: int
    rule: str = "fixed"
    param: float | None = None
    base: str | None = None
    component: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_rank(self.rank)
        check_rule(self.rule, self.param)


@dataclass(frozen=True, kw_only=True)
class CombineOptions(Output):
    """`combine`: PEFT's add_weighted_adapter `method` with its `weights` (one per adapter, default 1.0 each),
    `density`, `rank` and `svd_clamp` (svd methods), `seed` (dare) and `sign_method` (ties)."""

    weights: tuple[float, ...] = ()
    method: str = "cat"
    density: float | None = None
    rank: int | None = None
    seed: int = 0
    sign_method: str = "total"
    svd_clamp: float | None = None
    base: str | None = None
    component: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "weights", tuple(self.weights))
        if self.sign_method not in ("total", "frequency"):
            raise UsageError(f"--majority-sign {self.sign_method}: choose total or frequency")
        _check_method(self.method, self.density, self.rank, self.svd_clamp)

    def weights_for(self, adapters: list[str]) -> list[float]:
        """One weight per adapter (1.0 each when none were given); a count that does not match is refused."""
        if not adapters:
            raise UsageError("combine needs at least one --adapter")
        if not self.weights:
            return [1.0] * len(adapters)
        if len(self.weights) != len(adapters):
            raise UsageError(f"{len(self.weights)} --weight for {len(adapters)} --adapter: give one per adapter")
        return list(self.weights)


def check_rank(rank: int) -> None:
    if rank < 1:
        raise UsageError(f"--rank {rank}: give a positive rank")


def check_rule(rule: str, param: float | None) -> None:
    """A one-line error for a rule/parameter pair that cannot work, before any tensor is read."""
    if rule not in RANK_RULES:
        raise UsageError(f"--rank-rule {rule}: choose one of {', '.join(RANK_RULES)}")
    if rule == "fixed":
        return
    if param is None:
        raise UsageError(f"--rank-rule {rule} needs --rank-param (see `converter extract --help`)")
    if rule == "sv_ratio" and param < 1:
        raise UsageError(f"--rank-param {param}: sv_ratio keeps S > S₀/p, so p must be at least 1")
    if rule in ("sv_fro", "sv_cumulative") and not 0 < param <= 1:
        raise UsageError(f"--rank-param {param}: {rule} keeps a fraction, give a number in (0, 1]")
    if rule == "sv_epsilon" and param < 0:
        raise UsageError(f"--rank-param {param}: sv_epsilon is a threshold on singular values, give one >= 0")


def _check_method(method: str, density: float | None, rank: int | None, svd_clamp: float | None) -> None:
    if method not in METHODS:
        raise UsageError(f"--method {method}: choose one of {', '.join(METHODS)}")
    if method.removesuffix("_svd") in NEEDS_DENSITY and density is None:
        raise UsageError(f"--method {method} needs --density (the fraction of values kept, in (0, 1])")
    if density is not None and not 0 < density <= 1:
        raise UsageError(f"--density {density}: give the fraction of values kept, in (0, 1]")
    if rank is not None and method not in SVD_METHODS:
        raise UsageError(f"--rank applies to the svd methods only; {method} keeps the input ranks")
    if rank is not None:
        check_rank(rank)
    if svd_clamp is not None and (method not in SVD_METHODS or not 0 < svd_clamp <= 1):
        raise UsageError("--svd-clamp is a quantile in (0, 1] and applies to the svd methods only")
