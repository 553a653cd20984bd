"""An adapter saved under a model's older module names, given to PEFT under the names its model has now.

transformers 5 renames some models' modules when it loads an older checkpoint (Qwen2-VL's `model.layers.N` is
`model.language_model.layers.N` once loaded). An adapter trained under transformers 4 keeps the old names, and
PEFT, given no `key_mapping`, places none of its tensors. The merge places them on the checkpoint keys they name;
transformers' own loader says which module each of those keys becomes, and PEFT's own `key_mapping` (its loader's
renaming of adapter keys, made for exactly this) is given that answer, one exact module path at a time. So PEFT
reads and places every tensor itself, and both proofs run with PEFT as the referee.
"""

from __future__ import annotations

import re
from pathlib import Path

from converter.engine.model_class import LoadingRulesUnreadable, loaded_names
from converter.io.safetensors_file import SafetensorsFile

PREFIX = "base_model.model."
# where a key's module path ends (what follows is PEFT's own: an adapter's factors, a wrapper's copy)
ADAPTER_PARTS = (".lora_", ".base_layer.", ".modules_to_save.", ".trainable_tokens", ".token_adapter.")


def older_name_mapping(model, adapters: list[Path]) -> dict[str, str]:
    """PEFT's `key_mapping` (regex -> replacement, on keys without `base_model.model.`) for the adapter module
    paths `model` (not yet wrapped by PEFT) does not have, to the module transformers loads that path's weight
    as; empty when every path is the model's own or transformers renames none of them."""
    own = {name for name, _ in model.named_modules()}
    missing = sorted({p for p in _module_paths(adapters) if p not in own})
    if not missing:
        return {}
    try:
        loaded = loaded_names(model, [f"{p}.weight" for p in missing])
    except LoadingRulesUnreadable:
        return {}
    mapping = {}
    for new, old in loaded.items():
        if old is None or new == old:
            continue
        old_module, new_module = old.removesuffix(".weight"), new.removesuffix(".weight")
        if new_module in own:
            mapping[rf"^{re.escape(old_module)}(?=\.)"] = new_module
    return mapping


def _module_paths(adapters: list[Path]) -> set[str]:
    """The module paths the adapters' files name (from their headers); none where a key lacks PEFT's prefix
    (PEFT's key_mapping refuses such a file)."""
    paths = set()
    for folder in adapters:
        for f in folder.glob("adapter_model*.safetensors"):
            for key in SafetensorsFile(f).tensors:
                if not key.startswith(PREFIX):
                    return set()
                plain = key.removeprefix(PREFIX)
                cut = min((plain.find(part) for part in ADAPTER_PARTS if part in plain), default=-1)
                paths.add(plain[:cut] if cut > 0 else plain.rsplit(".", 1)[0])
    return paths
