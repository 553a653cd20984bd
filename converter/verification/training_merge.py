"""Verification of a merge whose base is a training checkpoint: PEFT is still the referee.

The checkpoint is written unmerged into a temp folder (base weights as stored + the LoRA inside as a PEFT
folder), and the usual verification proves the merged model against it: every tensor against PEFT's merge of
that LoRA (and any other adapters), and the behaviour against PEFT applying them unmerged. A checkpoint with
neither a LoRA nor adapters is proven tensor by tensor against its reassembly (each tensor must be the
checkpoint's own); there is no behaviour to compare.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

from converter.engine.base_reader import open_base
from converter.engine.recipe import AdapterSpec, Recipe
from converter.io.scratch import temp_folder
from converter.training.unmerged import write_unmerged
from converter.training.view import TrainingCheckpoint

NOTE = "the base is a training checkpoint: the referees saw it written unmerged (its weights, its LoRA as PEFT's)"


def verify_training(folder: Path, recipe: Recipe, verify: Callable, *, log: Callable[[str], None] = print, **kw):
    ckpt = open_base(
        Path(recipe.base),
        lora_alpha=recipe.base_lora_alpha,
        allow_pickle=recipe.allow_pickle,
        config=recipe.base_config,
    )
    if not isinstance(ckpt, TrainingCheckpoint):  # the run's weights are a Hugging Face folder inside it
        plain = copy.deepcopy(recipe)
        plain.base, plain.base_config = str(ckpt.folder), None
        return verify(folder, plain, log=log, **kw)
    with temp_folder("verify-training", log=log) as scratch:
        base, adapter = write_unmerged(ckpt, Path(scratch))
        unmerged = copy.deepcopy(recipe)
        unmerged.base, unmerged.base_config = str(base), None
        unmerged.adapters = ([AdapterSpec(str(adapter), 1.0)] if adapter else []) + list(recipe.adapters)
        log(f"verification: the training checkpoint written unmerged ({'base + its LoRA' if adapter else 'base'})")
        return verify(folder, unmerged, log=log, notes=(NOTE,), **kw)
