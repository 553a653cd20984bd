"""Verification of a merge whose base is a training checkpoint: PEFT's forward is still the oracle.

The checkpoint is written unmerged into a temp folder (base weights as stored + the LoRA inside as a PEFT
folder), and the usual verification compares the merged model with PEFT applying that LoRA (and any other
adapters) unmerged. A checkpoint with neither a LoRA nor adapters has nothing to prove beyond the reassembly,
which is exact by construction (each shard's bytes copied): that case is reported, not pretended; so is a LoRA on
fused MoE experts, which the adapter loader that verification uses cannot read yet.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

from converter.recipe import AdapterSpec, Recipe
from converter.scratch import temp_folder


def verify_training(folder: Path, recipe: Recipe, verify: Callable, *, log: Callable[[str], None] = print, **kw):
    from converter.checkpoint import open_base
    from converter.training.unmerged import write_unmerged

    ckpt = open_base(
        Path(recipe.base),
        lora_alpha=recipe.base_lora_alpha,
        allow_pickle=recipe.allow_pickle,
        config=recipe.base_config,
    )
    from converter.training.view import TrainingCheckpoint

    if not isinstance(ckpt, TrainingCheckpoint):  # the run's weights are a Hugging Face folder inside it
        plain = copy.deepcopy(recipe)
        plain.base, plain.base_config = str(ckpt.folder), None
        return verify(folder, plain, log=log, **kw)
    if not ckpt.lora and not ckpt.expert_lora and not recipe.adapters:
        return _skipped(
            "there is nothing to compare with (no LoRA in the checkpoint, no adapters): the base was reassembled "
            "from its shards byte for byte",
            log,
        )
    with temp_folder("verify-training", log=log) as scratch:
        base, adapter = write_unmerged(ckpt, Path(scratch))
        unmerged = copy.deepcopy(recipe)
        unmerged.base = str(base)
        unmerged.adapters = ([AdapterSpec(str(adapter), 1.0)] if adapter else []) + list(recipe.adapters)
        log(f"verification: the training checkpoint written unmerged ({'base + its LoRA' if adapter else 'base'})")
        return verify(folder, unmerged, log=log, **kw)


def _skipped(reason: str, log: Callable[[str], None]) -> dict:
    log(f"verification skipped: {reason}")
    return {"verdict": "skipped", "problems": [], "notes": [reason],
            "markdown": f"**Not verified**: verification was skipped because {reason}."}  # fmt: skip
