"""Community files into transformers bases: a kohya text-encoder LoRA into a CLIP text encoder folder, and a
PEFT weights file shared without its adapter_config.json into a Llama (PEFT's own merge as the oracle)."""

from __future__ import annotations

import shutil

import torch
from conftest import make_adapter, make_base, peft_merged_fp64, read_tensors
from diffusion_helpers import TE_TARGETS, kohya_lora, kohya_modules, save, tiny_clip


def test_kohya_text_encoder_lora_into_a_clip_folder(tmp_path, cli):
    clip = tiny_clip(24)
    clip.save_pretrained(tmp_path / "clip")
    modules = kohya_modules(clip, "lora_te", TE_TARGETS)
    assert all(name.startswith("lora_te_text_model_encoder_layers_") for name in modules)
    lora = kohya_lora(modules, rank=3, alpha=1.5)
    save(lora, tmp_path / "te.safetensors")
    code, out, err = cli(
        "merge", "--base", tmp_path / "clip", "--adapter", tmp_path / "te.safetensors", "--out", tmp_path / "m"
    )
    assert code == 0, err
    assert "(clip keymap)" in out
    ours, before = read_tensors(tmp_path / "m"), read_tensors(tmp_path / "clip")
    for name, (path, _) in modules.items():
        alpha = float(lora[f"{name}.alpha"])
        delta = lora[f"{name}.lora_up.weight"] @ lora[f"{name}.lora_down.weight"] * alpha / 3
        torch.testing.assert_close(ours[f"{path}.weight"], before[f"{path}.weight"] + delta, atol=1e-6, rtol=1e-6)


def test_peft_weights_without_their_config_merge_with_scale_one_and_say_so(tmp_path, cli):
    base = make_base(tmp_path / "base", "llama")
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=4, target_modules=["q_proj", "down_proj"])
    (tmp_path / "bare").mkdir()
    shutil.copy(adapter / "adapter_model.safetensors", tmp_path / "bare" / "lora.safetensors")
    code, out, err = cli(
        "merge", "--base", base, "--adapter", tmp_path / "bare" / "lora.safetensors", "--out", tmp_path / "m"
    )
    assert code == 0, err
    assert "no alpha anywhere" in out and "scale 1" in out
    ours, reference = read_tensors(tmp_path / "m"), peft_merged_fp64(base, adapter)
    changed = 0
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[name].float(), atol=1e-6, rtol=1e-6)
        changed += "q_proj" in name or "down_proj" in name
    assert changed == 4
