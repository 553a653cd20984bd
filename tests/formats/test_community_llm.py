"""Community files into transformers bases: a kohya text-encoder LoRA into a CLIP text encoder folder, and a
PEFT weights file shared without its adapter_config.json into a Llama (PEFT's own merge as the oracle)."""

from __future__ import annotations

import shutil

import torch
from diffusion_helpers import TE_TARGETS, kohya_lora, kohya_modules, save, tiny_clip
from model_helpers import make_adapter, make_base, peft_merged_fp64, read_tensors


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


def test_peft_weights_without_their_config_need_a_stated_alpha(tmp_path, cli):
    """alpha and r live in adapter_config.json: without it the scale is unknown, so the merge is refused (it
    used to be merged at scale 1, wrong whenever lora_alpha != r) unless --lora-alpha / a recipe's lora_alpha
    states it; r is then each module's rank. PEFT's own merge (with the config) is the oracle."""
    import yaml

    base = make_base(tmp_path / "base", "llama")
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    (tmp_path / "bare").mkdir()
    shutil.copy(adapter / "adapter_model.safetensors", tmp_path / "bare" / "lora.safetensors")
    bare = tmp_path / "bare" / "lora.safetensors"
    code, out, err = cli("merge", "--base", base, "--adapter", bare, "--out", tmp_path / "m")
    assert code == 2, out + err
    assert len(err.strip().splitlines()) == 1 and "adapter_config.json" in err and "--lora-alpha" in err, err
    assert not (tmp_path / "m").exists()
    code, out, err = cli("inspect", bare)  # inspect still describes it, and says why a merge needs more
    assert code == 0 and "lora_alpha: unknown (no adapter_config.json" in out, out + err

    reference = peft_merged_fp64(base, adapter)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"base": str(base), "adapters": [{"source": str(bare), "lora_alpha": 8}]}))
    for how in (["--adapter", bare, "--lora-alpha", "8"], ["--recipe", recipe]):
        out_dir = tmp_path / f"m{len(how)}"
        code, out, err = cli("merge", "--base", base, *how, "--out", out_dir)
        assert code == 0, err
        ours = read_tensors(out_dir)
        changed = 0
        for name, tensor in ours.items():
            torch.testing.assert_close(tensor, reference[name].float(), atol=1e-6, rtol=1e-6)
            changed += "q_proj" in name or "down_proj" in name
        assert changed == 4
        assert "lora_alpha: 8" in (out_dir / "converter_recipe.yaml").read_text()  # the rerunnable record


def test_a_stated_alpha_must_not_contradict_the_files(tmp_path, cli):
    base = make_base(tmp_path / "base", "llama")
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj"])
    code, out, err = cli("merge", "--base", base, "--adapter", adapter, "--lora-alpha", "4", "--out", tmp_path / "m")
    assert code == 2 and "lora_alpha=8" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "m").exists()
    code, _, err = cli("merge", "--base", base, "--adapter", adapter, "--lora-alpha", "8", "--out", tmp_path / "m")
    assert code == 0, err
