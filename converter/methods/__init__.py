"""Beyond a plain sum: extract a LoRA from a fine-tune, resize a LoRA, combine several LoRAs into one.

Each is a per-module job over adapter factors (or, for `extract`, one base/tuned tensor pair at a time):
`options` (the names the CLI offers), `ranks` (how many singular values a module keeps), `tensors` (TIES / DARE /
magnitude pruning on one tensor), `combine` (`add_weighted_adapter`'s methods), `extract`, `resize`, `cli` (the
three subcommands). The math runs in float32 (SVDs in float64, whose cost is small next to reading the weights).
Submodules load on first use, so building the command line does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"combine": "combine", "CombineResult": "combine", "extract": "extract", "ExtractResult": "extract",
            "resize": "resize", "ResizeResult": "resize", "choose_rank": "ranks", "METHODS": "options",
            "RANK_RULES": "options"}  # fmt: skip

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"converter.methods.{_EXPORTS[name]}"), name)
