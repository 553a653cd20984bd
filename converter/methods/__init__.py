"""Beyond a plain sum: extract a LoRA from a fine-tune, resize a LoRA, combine several LoRAs into one.

Each is a per-module job over adapter factors (or, for `extract`, one base/tuned tensor pair at a time):
`options` (the names the CLI offers), `ranks` (how many singular values a module keeps), `combination`
(`add_weighted_adapter`'s methods), `extraction`, `resizing`. TIES / DARE on tensors and `converter merge --method`
are the engine's (converter.engine.ties_dare, taskmerge); the subcommands are converter.cli.methods. The modules are
not named after the functions, so `from converter.methods import combine` is always the function. The math runs in
float32 (full SVDs too; the small SVDs of stacked LoRA factors in float64). Submodules load on first use, so
building the command line does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"combine": "combination", "CombineResult": "combination", "extract": "extraction",
            "ExtractResult": "extraction", "resize": "resizing", "ResizeResult": "resizing", "choose_rank": "ranks",
            "METHODS": "options", "RANK_RULES": "options"}  # fmt: skip

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"converter.methods.{_EXPORTS[name]}"), name)
