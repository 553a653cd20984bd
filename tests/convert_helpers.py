"""ΔW of an adapter on a base, through converter's own patch math (the merge plan applied to zeros), and
diffusers' own `load_lora_weights` on a pipeline-like holder of tiny models."""

from __future__ import annotations

import copy
from pathlib import Path

import torch


def deltas(adapter: Path, base: Path) -> dict[str, torch.Tensor]:
    """{base key: ΔW} for every tensor the adapter changes, each patch applied to zeros in float32."""
    from converter.engine.base_reader import open_base
    from converter.engine.keymap import keymap_for
    from converter.engine.plan import build_plan
    from converter.engine.recipe import AdapterSpec
    from converter.formats import load_adapter

    checkpoint = open_base(base)
    loaded = load_adapter(adapter)
    plan = build_plan(checkpoint, [(loaded, AdapterSpec(str(adapter)))], keymap_for(checkpoint.config), None)
    out = {}
    for o in plan.changed:
        w = torch.zeros(o.shape)
        for p in o.patches:
            view = w if p.rows is None else w[p.rows[0] : p.rows[1]]
            result = p.patch.apply(view, p.transposed)
            assert result.data_ptr() == view.data_ptr()  # patches add in place
        out[o.name] = w
    return out


def assert_same_deltas(a: dict, b: dict, exact: bool = True) -> None:
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    assert a, "no tensor changes: the comparison would mean nothing"
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), f"{k}: max |diff| {(a[k] - b[k]).abs().max()}"
        else:
            torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def diffusers_load_lora_weights(models: dict, folder: Path, weight_name: str, xl: bool = False) -> dict:
    """diffusers' `load_lora_weights` (the pipeline method, on a holder with the pipeline's attributes) on
    fresh copies of the models, then PEFT's merge of every injected layer: {component: state dict}."""
    from diffusers.loaders.lora_pipeline import StableDiffusionLoraLoaderMixin, StableDiffusionXLLoraLoaderMixin
    from diffusion_helpers import peft_merge

    mixin = StableDiffusionXLLoraLoaderMixin if xl else StableDiffusionLoraLoaderMixin

    class Holder(mixin):
        hf_device_map = None  # what a DiffusionPipeline has when nothing is offloaded

        @property
        def components(self) -> dict:
            return copies

    holder = Holder()
    copies = {k: copy.deepcopy(v) for k, v in models.items()}
    for name, model in copies.items():
        setattr(holder, name, model)
    holder.load_lora_weights(str(folder), weight_name=weight_name)
    return {k: peft_merge(m) for k, m in copies.items()}
