"""`convert --to peft` of a kohya SDXL file writes the module names PEFT and diffusers use today.

sd-scripts names SDXL's text encoders by transformers 4's paths (`lora_te1_text_model_encoder_layers_0_...`), and the
public SDXL checkpoints' CLIP-L files keep transformers 4's `text_model.` keys; transformers 5's CLIPTextModel has no
such level, its CLIPTextModelWithProjection (text_encoder_2) keeps it. The oracle is PEFT itself: the keys PEFT saves
for a LoRA on the same modules of the models transformers 5 builds.
"""

from __future__ import annotations

import json

from diffusion_helpers import make_pipeline, save
from safetensors import safe_open
from safetensors.torch import load_file


def peft_keys(model, targets: list[str]) -> set[str]:
    """The keys PEFT's save_pretrained writes for a LoRA on `targets` of `model` (a copy of it is wrapped)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict

    wrapped = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=targets))
    return set(get_peft_model_state_dict(wrapped))


def test_kohya_sdxl_to_peft_names_the_text_encoders_as_peft_does_today(tmp_path, cli):
    from test_community_sd import sdxl_lora

    base = tmp_path / "sdxl"
    models = make_pipeline(base, "sdxl")
    te = base / "text_encoder" / "model.safetensors"  # as the public SDXL checkpoints: transformers 4's keys
    save({f"text_model.{k}": v for k, v in load_file(te).items()}, te, metadata={"format": "pt"})
    lora = sdxl_lora(models, ldm=True)  # sd-scripts' own spelling: SGM UNet blocks, text_model in both encoders
    assert any(k.startswith("lora_te1_text_model_encoder_") for k in lora)
    src = save(lora, tmp_path / "lora.safetensors")
    code, _, err = cli("convert", "--adapter", src, "--to", "peft", "--out", tmp_path / "p", "--base", base)
    assert code == 0, err
    for component in ("text_encoder", "text_encoder_2"):
        folder = tmp_path / "p" / component
        targets = json.loads((folder / "adapter_config.json").read_text())["target_modules"]
        with safe_open(folder / "adapter_model.safetensors", "pt") as f:
            ours = set(f.keys())
        assert ours == peft_keys(models[component], sorted(targets)), component
    assert not any("text_model" in t for t in json.loads(
        (tmp_path / "p" / "text_encoder" / "adapter_config.json").read_text())["target_modules"])  # fmt: skip
