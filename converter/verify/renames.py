"""Which file tensor each parameter of a transformers model is loaded from, by transformers' own loading rules.

transformers 5 renames some checkpoint keys when it loads them (a CLIPTextModel drops the `text_model.` that every
checkpoint saved before it spells; legacy `gamma`/`beta`; per-architecture renames), so a module's path in the
built model is not always its tensor's name in the base's files. The answer here is transformers' own: its
conversion mapping for the model (`get_model_conversion_mapping`, per sub-model, as `from_pretrained` collects it)
applied to each file key the way its loader applies it (`rename_source_key`, then the same retry with only the
base model prefix), never a table of ours. Keys that a conversion fuses or splits (MoE experts) have no
one-to-one parameter and are left out.
"""

from __future__ import annotations

from collections.abc import Iterable


class LoadingRulesUnreadable(Exception):
    """transformers' loading rules could not be asked here (its internals moved): the names are taken as they are."""


def loaded_names(model, file_keys: Iterable[str]) -> dict[str, str]:
    """{state-dict name in `model`: the file key transformers loads it from}, for every key it loads by a rename
    only (a key it keeps as it is maps to itself). Ask before PEFT wraps the model's modules (its `base_layer`
    names are not the model's). Models that are not transformers' map to themselves."""
    keys = list(file_keys)
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - diffusers' text encoders need transformers
        return {k: k for k in keys}
    if not isinstance(model, PreTrainedModel):
        return {k: k for k in keys}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError as e:
        raise LoadingRulesUnreadable(f"transformers' loading rules cannot be read here ({e})") from None
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    prefix, meta = model.base_model_prefix, model.state_dict()  # a weightless model's: stand-ins, no memory
    out: dict[str, str] = {}
    for key in keys:
        name, fused = rename_source_key(key, renamings, converters, prefix, meta)
        if name not in meta and key in meta:  # as transformers' loader: only the base model prefix, then
            name, fused = rename_source_key(key, [], [], prefix, meta)
        if name in meta and fused is None:
            out.setdefault(name, key)
    return out
