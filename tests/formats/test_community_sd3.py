"""SD3 / SD3.5 (MMDiT): diffusers-format and kohya LoRAs into diffusers folders and original single files.

The original single file is built from the diffusers transformer and must convert back exactly with diffusers'
own convert_sd3_transformer_checkpoint_to_diffusers; merged single files are converted back the same way and
compared with diffusers' own LoRA loader.
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusion_helpers import _perturb, assert_matches, peft_merge, read_component, save


def tiny_sd3():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=8,
        patch_size=1,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=12,
        caption_projection_dim=16,
        pooled_projection_dim=12,
        out_channels=4,
        pos_embed_max_size=16,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    )
    return _perturb(model, 0)


def swap(t):  # [shift, scale] <-> [scale, shift]
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a])


def to_original(sd: dict, n: int = 2) -> dict:
    o = {"pos_embed": sd["pos_embed.pos_embed"]}
    plain = {
        "x_embedder.proj": "pos_embed.proj",
        "context_embedder": "context_embedder",
        "final_layer.linear": "proj_out",
        "t_embedder.mlp.0": "time_text_embed.timestep_embedder.linear_1",
        "t_embedder.mlp.2": "time_text_embed.timestep_embedder.linear_2",
        "y_embedder.mlp.0": "time_text_embed.text_embedder.linear_1",
        "y_embedder.mlp.2": "time_text_embed.text_embedder.linear_2",
    }
    for i in range(n):
        j, t = f"joint_blocks.{i}", f"transformer_blocks.{i}"
        plain |= {
            f"{j}.x_block.attn.proj": f"{t}.attn.to_out.0",
            f"{j}.x_block.mlp.fc1": f"{t}.ff.net.0.proj",
            f"{j}.x_block.mlp.fc2": f"{t}.ff.net.2",
            f"{j}.x_block.adaLN_modulation.1": f"{t}.norm1.linear",
            f"{j}.x_block.attn.ln_q": f"{t}.attn.norm_q",
            f"{j}.x_block.attn.ln_k": f"{t}.attn.norm_k",
            f"{j}.context_block.attn.ln_q": f"{t}.attn.norm_added_q",
            f"{j}.context_block.attn.ln_k": f"{t}.attn.norm_added_k",
        }
        for p in ("weight", "bias"):
            o[f"{j}.x_block.attn.qkv.{p}"] = torch.cat([sd[f"{t}.attn.to_{x}.{p}"] for x in "qkv"])
            o[f"{j}.context_block.attn.qkv.{p}"] = torch.cat([sd[f"{t}.attn.add_{x}_proj.{p}"] for x in "qkv"])
            if f"{t}.attn2.to_q.{p}" in sd:
                o[f"{j}.x_block.attn2.qkv.{p}"] = torch.cat([sd[f"{t}.attn2.to_{x}.{p}"] for x in "qkv"])
                o[f"{j}.x_block.attn2.proj.{p}"] = sd[f"{t}.attn2.to_out.0.{p}"]
            last = i == n - 1
            ctx = sd[f"{t}.norm1_context.linear.{p}"]
            o[f"{j}.context_block.adaLN_modulation.1.{p}"] = swap(ctx) if last else ctx
            if not last:
                o[f"{j}.context_block.attn.proj.{p}"] = sd[f"{t}.attn.to_add_out.{p}"]
                o[f"{j}.context_block.mlp.fc1.{p}"] = sd[f"{t}.ff_context.net.0.proj.{p}"]
                o[f"{j}.context_block.mlp.fc2.{p}"] = sd[f"{t}.ff_context.net.2.{p}"]
        if f"{t}.attn2.norm_q.weight" in sd:
            plain |= {f"{j}.x_block.attn2.ln_q": f"{t}.attn2.norm_q", f"{j}.x_block.attn2.ln_k": f"{t}.attn2.norm_k"}
    for orig, diff in plain.items():
        for p in ("weight", "bias"):
            if f"{diff}.{p}" in sd:
                o[f"{orig}.{p}"] = sd[f"{diff}.{p}"]
    o["final_layer.adaLN_modulation.1.weight"] = swap(sd["norm_out.linear.weight"])
    o["final_layer.adaLN_modulation.1.bias"] = swap(sd["norm_out.linear.bias"])
    return {f"model.diffusion_model.{k}": v for k, v in o.items()}


def from_original(sd: dict) -> dict:
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    return convert_sd3_transformer_checkpoint_to_diffusers(dict(sd))


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    root = tmp_path_factory.mktemp("sd3")
    model = tiny_sd3()
    model.save_pretrained(root / "pipe" / "transformer")
    (root / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    original = to_original(model.state_dict())
    back = from_original(original)
    base = model.state_dict()
    assert set(back) == set(base) and all(torch.equal(back[k], base[k]) for k in base)
    return model, root / "pipe", save(original, root / "sd3.5-tiny.safetensors")


def test_diffusers_sd3_lora_into_folder_and_original_file(sd3, tmp_path, cli):
    import copy

    from diffusers.loaders.lora_pipeline import SD3LoraLoaderMixin
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    model, folder, single = sd3
    targets = [
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_v_proj",
        "to_add_out",
        "ff.net.0.proj",
        "ff_context.net.2",
        "norm1.linear",
    ]
    config = LoraConfig(r=2, lora_alpha=6, target_modules=targets, init_lora_weights=False)
    trained = copy.deepcopy(model)
    trained.add_adapter(config)
    SD3LoraLoaderMixin.save_lora_weights(
        tmp_path / "lora",
        transformer_lora_layers=get_peft_model_state_dict(trained),
        transformer_lora_adapter_metadata=config.to_dict(),
    )
    reference = peft_merge(trained)
    base = model.state_dict()
    adapter = tmp_path / "lora" / "pytorch_lora_weights.safetensors"
    assert cli("merge", "--base", folder, "--adapter", adapter, "--out", tmp_path / "f")[0] == 0
    assert_matches(read_component(tmp_path / "f", "transformer"), reference, base, atol=1e-5)
    assert cli("merge", "--base", single, "--adapter", adapter, "--out", tmp_path / "s")[0] == 0
    merged = from_original(load_file(tmp_path / "s" / "sd3.5-tiny.safetensors"))
    assert_matches(merged, reference, base, atol=1e-5)


def kohya_sd3_lora(original: dict) -> dict:
    """sd-scripts networks/lora_sd3.py naming: lora_unet_<MMDiT module path, '.' -> '_'>."""
    g = torch.Generator().manual_seed(3)
    out = {}
    for key, value in original.items():
        path = key[len("model.diffusion_model.") :]
        if not path.endswith(".weight") or value.dim() != 2 or "joint_blocks" not in path or "ln_" in path:
            continue
        name = "lora_unet_" + path[: -len(".weight")].replace(".", "_")
        out[f"{name}.lora_down.weight"] = torch.randn(3, value.shape[1], generator=g) * 0.2
        out[f"{name}.lora_up.weight"] = torch.randn(value.shape[0], 3, generator=g) * 0.2
        out[f"{name}.alpha"] = torch.tensor(1.5)
    return out


def test_kohya_sd3_lora_into_original_file_and_diffusers_folder(sd3, tmp_path, cli):
    """Into the original file every module is the formula; into the diffusers folder the fused qkv LoRAs are split
    over to_q/to_k/to_v and the last block's swapped context adaLN is refused rather than misplaced."""
    from safetensors.torch import load_file

    model, folder, single = sd3
    original = load_file(single)
    lora = kohya_sd3_lora(original)
    save(lora, tmp_path / "lora.safetensors", {"ss_network_module": "networks.lora_sd3"})
    assert cli("merge", "--base", single, "--adapter", tmp_path / "lora.safetensors", "--out", tmp_path / "s")[0] == 0
    merged = load_file(tmp_path / "s" / "sd3.5-tiny.safetensors")
    for key, before in original.items():
        name = "lora_unet_" + key[len("model.diffusion_model.") : -len(".weight")].replace(".", "_")
        expected = before
        if key.endswith(".weight") and f"{name}.lora_down.weight" in lora:
            expected = before + lora[f"{name}.lora_up.weight"] @ lora[f"{name}.lora_down.weight"] * 0.5
        torch.testing.assert_close(merged[key], expected, atol=1e-6, rtol=1e-6)

    code, _, err = cli("merge", "--base", folder, "--adapter", tmp_path / "lora.safetensors", "--out", tmp_path / "x")
    assert code == 2 and "joint_blocks_1_context_block_adaLN_modulation_1" in err
    del lora["lora_unet_joint_blocks_1_context_block_adaLN_modulation_1.lora_down.weight"]
    del lora["lora_unet_joint_blocks_1_context_block_adaLN_modulation_1.lora_up.weight"]
    del lora["lora_unet_joint_blocks_1_context_block_adaLN_modulation_1.alpha"]
    save(lora, tmp_path / "lora2.safetensors")
    for base, out in ((single, "s2"), (folder, "f2")):
        assert (
            cli("merge", "--base", base, "--adapter", tmp_path / "lora2.safetensors", "--out", tmp_path / out)[0] == 0
        )
    via_file = from_original(load_file(tmp_path / "s2" / "sd3.5-tiny.safetensors"))
    assert_matches(read_component(tmp_path / "f2", "transformer"), via_file, model.state_dict(), atol=1e-6)


def test_kohya_sd3_to_peft_takes_diffusers_names_from_a_folder_or_the_original_file(sd3, tmp_path, cli):
    """A PEFT folder loads onto diffusers' SD3 transformer: against the diffusers folder the kohya file becomes
    diffusers' modules, and against the original single file too (its fused qkv split over to_q / to_k / to_v as
    the keymap's aliases relay the MMDiT's names): the same files, and PEFT's merge of them is ours. The last
    block's swapped context adaLN has no diffusers module: refused in one line, nothing written."""
    import copy

    from peft import PeftModel
    from safetensors.torch import load_file

    model, folder, single = sd3
    full = kohya_sd3_lora(load_file(single))
    swapped = "lora_unet_joint_blocks_1_context_block_adaLN_modulation_1"  # no diffusers module: see above
    lora = {k: v for k, v in full.items() if not k.startswith(swapped)}
    src = save(lora, tmp_path / "lora.safetensors", {"ss_network_module": "networks.lora_sd3"})
    bad = save(full, tmp_path / "full.safetensors", {"ss_network_module": "networks.lora_sd3"})
    code, _, err = cli("convert", "--adapter", bad, "--to", "peft", "--out", tmp_path / "x", "--base", single)
    assert code == 2 and len(err.strip().splitlines()) == 1 and swapped in err, err
    assert not (tmp_path / "x").exists()
    for base, out in ((single, "s"), (folder, "p")):
        code, _, err = cli("convert", "--adapter", src, "--to", "peft", "--out", tmp_path / out, "--base", base)
        assert code == 0, err
    via_file, via_folder = (load_file(tmp_path / o / "adapter_model.safetensors") for o in ("s", "p"))
    assert via_file.keys() == via_folder.keys() and all(torch.equal(via_file[k], via_folder[k]) for k in via_file)
    assert any(".attn.to_k.lora_A." in k for k in via_file)
    with_peft = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "s").merge_and_unload().state_dict()
    assert cli("merge", "--base", folder, "--adapter", src, "--out", tmp_path / "m")[0] == 0
    ours = read_component(tmp_path / "m", "transformer")
    assert_matches(ours, {k: with_peft[k] for k in ours}, model.state_dict(), atol=1e-6)
