"""The names the command line offers, without importing torch (the parser is built for every command)."""

from __future__ import annotations

FACTOR_METHODS = ("linear", "ties", "dare_linear", "dare_ties", "magnitude_prune")
SVD_METHODS = ("svd", "ties_svd", "dare_linear_svd", "dare_ties_svd", "magnitude_prune_svd")
METHODS = ("cat", *FACTOR_METHODS, *SVD_METHODS)
NEEDS_DENSITY = {"ties", "dare_linear", "dare_ties", "magnitude_prune"}
RANK_RULES = ("fixed", "sv_ratio", "sv_fro", "sv_cumulative", "sv_epsilon")
