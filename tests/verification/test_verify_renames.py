"""model_class.loaded_names against transformers' own loading: for the text encoders of diffusion pipelines, saved as
their checkpoints spell them, every file key it maps lands, in a model loaded by `from_pretrained`, on the
parameter it names, and every file key is mapped. Tiny models from configs; CLIP's file as transformers 4 wrote it
(`text_model.`), Qwen2.5-VL's and Mistral3's as transformers 5 saves them (their pre-5 layout, renamed again on
load)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file


def clip(projection: bool):
    from diffusion_helpers import tiny_clip

    return tiny_clip(12, projection=projection)


def t5():
    from test_community_flux import tiny_t5

    return tiny_t5()


def qwen25_vl():
    """Qwen-Image's text encoder."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                  fullatt_block_indexes=[0])  # fmt: skip
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision))


def mistral3():
    """FLUX.2's text encoder (saved as `language_model.model.*`, loaded as `model.language_model.*`)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = dict(model_type="mistral", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8)  # fmt: skip
    vision = dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, head_dim=8, image_size=16, patch_size=4)  # fmt: skip
    torch.manual_seed(0)
    config = Mistral3Config(text_config=text, vision_config=vision, spatial_merge_size=2)
    return Mistral3ForConditionalGeneration(config)


MODELS = {"clip": lambda: clip(False), "clip-projection": lambda: clip(True), "t5": t5, "qwen2.5-vl": qwen25_vl,
          "mistral3": mistral3}  # fmt: skip


@pytest.mark.parametrize("kind", list(MODELS))
def test_every_file_key_maps_to_the_parameter_transformers_loads_it_into(kind, tmp_path):
    from accelerate import init_empty_weights

    from converter.engine.model_class import loaded_names
    from converter.verification.peft_referee import hollow

    model = MODELS[kind]()
    model.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    if kind == "clip":  # as transformers 4 wrote it (every SD 1.5 / SDXL / Flux checkpoint)
        save_file({f"text_model.{k}": v for k, v in load_file(file).items()}, file, metadata={"format": "pt"})
    saved = load_file(file)
    cls = type(model)
    with init_empty_weights():
        empty = cls._from_config(model.config, dtype=torch.float32)
    hollow(empty)
    names = loaded_names(empty, saved)
    assert sorted(names.values()) == sorted(saved), set(saved) - set(names.values())
    renamed = {name: key for name, key in names.items() if name != key}
    assert renamed or kind in ("clip-projection", "t5")  # the renamed ones are what this is for
    loaded = cls.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    for name, key in names.items():
        assert torch.equal(loaded[name], saved[key]), (name, key)


@pytest.mark.parametrize("saved", ["transformers 4", "transformers 5"])
def test_peft_text_encoder_folder_of_an_llm_loads_under_the_models_names(tmp_path, saved):
    """Qwen-Image's text encoder (Qwen2.5-VL): a PEFT folder saved before transformers 5 spells its modules
    `model.layers...` (now `model.language_model.layers...`); the per-component referee's injection places every
    LoRA factor of it, and of one saved today, on the module PEFT trained it on."""
    import copy

    from peft import LoraConfig, get_peft_model

    from converter.engine.model_class import loaded_names
    from converter.verification.diffusers_loader import component_model
    from converter.verification.diffusers_referee import _inject

    model = qwen25_vl()
    model.save_pretrained(tmp_path / "pipe" / "text_encoder")
    trained = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj", "v_proj", "down_proj"],
                                                              init_lora_weights=False))  # fmt: skip
    trained.save_pretrained(tmp_path / "lora")
    if saved == "transformers 4":
        f = tmp_path / "lora" / "adapter_model.safetensors"
        save_file({k.replace(".model.language_model.", ".model."): v for k, v in load_file(f).items()}, f)
        assert any(".model.model.layers." in k for k in load_file(f))
    index = {"text_encoder": ["transformers", type(model).__name__]}
    empty = component_model(tmp_path / "pipe", "text_encoder", index, empty=True)
    files = load_file(tmp_path / "pipe" / "text_encoder" / "model.safetensors")
    _inject(empty, tmp_path / "lora", "a0", 1.0, loaded_names(empty, files))
    reference = dict(trained.named_modules())
    placed = 0
    for name, module in empty.named_modules():
        if "a0" in getattr(module, "lora_A", {}):
            for factor in ("lora_A", "lora_B"):
                expected = getattr(reference[f"base_model.model.{name}"], factor)["default"].weight
                assert torch.equal(getattr(module, factor)["a0"].weight, expected), name
            placed += 1
    assert placed == sum("default" in getattr(m, "lora_A", {}) for m in trained.modules()) > 2
