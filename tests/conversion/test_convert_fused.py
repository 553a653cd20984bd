"""Fused ↔ split while converting (FLUX.1: BFL img_attn.qkv / single_blocks.linear1 vs diffusers to_q/to_k/to_v
/proj_mlp). Splitting shares the down matrix unless the up matrix is block-diagonal (kohya's split_qkv layout,
checked exactly), fusing stacks the downs under a block-diagonal up; ΔW is unchanged either way."""

from __future__ import annotations

import json

import pytest
import torch
from convert_helpers import assert_same_deltas, deltas
from diffusion_helpers import assert_matches, read_component, save
from safetensors.torch import load_file
from test_community_flux import H, diffusers_reference, kohya_flux_lora, tiny_flux, to_bfl


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux-convert")
    model = tiny_flux()
    folder = root / "pipeline"
    model.save_pretrained(folder / "transformer")
    (folder / "model_index.json").write_text(
        json.dumps({"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]})
    )
    bfl = save(to_bfl(model.state_dict()), root / "flux1-tiny.safetensors")
    return model, folder, bfl


def test_kohya_fused_modules_split_onto_diffusers_names_with_a_shared_down(flux, tmp_path, cli):
    model, folder, bfl = flux
    src = save(kohya_flux_lora(model, with_linear1=True), tmp_path / "lora.safetensors")
    code, _, err = cli("convert", "--adapter", src, "--to", "diffusers", "--out", tmp_path / "d", "--base", folder)
    assert code == 0, err
    out = load_file(tmp_path / "d" / "pytorch_lora_weights.safetensors")
    lora = load_file(src)
    down = lora["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"]
    for x in ("q", "k", "v"):  # dense up: every part keeps the whole down, rank 3
        assert torch.equal(out[f"transformer.transformer_blocks.0.attn.to_{x}.lora_A.weight"], down)
    assert out["transformer.single_transformer_blocks.1.proj_mlp.lora_B.weight"].shape == (4 * H, 3)
    assert_same_deltas(deltas(tmp_path / "d" / "pytorch_lora_weights.safetensors", folder), deltas(src, folder))
    # diffusers' Flux loader on the converted file (alphas from lora_adapter_metadata) = our merge of the original
    reference = diffusers_reference(model, tmp_path / "d" / "pytorch_lora_weights.safetensors")
    assert cli("merge", "--base", folder, "--adapter", src, "--out", tmp_path / "m")[0] == 0
    assert_matches(read_component(tmp_path / "m", "transformer"), reference, model.state_dict(), atol=1e-5)

    # a BFL single file as the base: its names are relaid in diffusers' (the keymap's aliases), same file
    code, _, err = cli("convert", "--adapter", src, "--to", "diffusers", "--out", tmp_path / "x", "--base", bfl)
    assert code == 0, err
    assert load_file(tmp_path / "x" / "pytorch_lora_weights.safetensors").keys() == out.keys()
    assert_same_deltas(deltas(tmp_path / "x" / "pytorch_lora_weights.safetensors", folder), deltas(src, folder))

    # kohya output names BFL's modules (what sd-scripts, ComfyUI and diffusers read) even from a diffusers folder
    k = tmp_path / "kohya.safetensors"
    assert cli("convert", "--adapter", tmp_path / "d", "--to", "kohya", "--out", k, "--base", folder)[0] == 0
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in load_file(k)
    assert_same_deltas(deltas(k, folder), deltas(src, folder), exact=False)

    # and back onto the BFL layout: q/k/v (and mlp) fuse into one module with a block-diagonal up
    back = tmp_path / "back.safetensors"
    code, _, err = cli("convert", "--adapter", tmp_path / "d", "--to", "kohya", "--out", back, "--base", bfl)
    assert code == 0, err
    fused = load_file(back)
    assert fused["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape == (9, H)
    assert fused["lora_unet_single_blocks_1_linear1.lora_up.weight"].shape == (7 * H, 12)
    assert_same_deltas(deltas(back, bfl), deltas(src, bfl), exact=False)


def test_block_diagonal_up_splits_the_down_too(flux, tmp_path, cli):
    """sd-scripts' split_qkv layout (docs/FORMATS.md §8): each part gets its own rows of down (rank r/3) with the
    scale the file implies (alpha / 3r, like every loader), so ΔW is unchanged."""
    model, folder, bfl = flux
    g = torch.Generator().manual_seed(4)
    r, name = 2, "lora_unet_double_blocks_1_img_attn_qkv"
    downs = [torch.randn(r, H, generator=g) for _ in range(3)]
    ups = [torch.randn(H, r, generator=g) for _ in range(3)]
    lora = {
        f"{name}.lora_down.weight": torch.cat(downs),
        f"{name}.lora_up.weight": torch.block_diag(*ups),
        f"{name}.alpha": torch.tensor(4.0),
    }
    dense = "lora_unet_double_blocks_1_txt_attn_qkv"  # rank 3r too, but a dense up: the down must stay whole
    lora[f"{dense}.lora_down.weight"] = torch.randn(3 * r, H, generator=g)
    lora[f"{dense}.lora_up.weight"] = torch.block_diag(*ups)
    lora[f"{dense}.lora_up.weight"][0, -1] = 0.5
    src = save(lora, tmp_path / "split.safetensors")
    code, out, err = cli("convert", "--adapter", src, "--to", "peft", "--out", tmp_path / "p", "--base", folder)
    assert code == 0, err
    assert "split_qkv" in out
    peft = load_file(tmp_path / "p" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "p" / "adapter_config.json").read_text())
    for j, x in enumerate("qkv"):
        key = f"base_model.model.transformer_blocks.1.attn.to_{x}"
        assert torch.equal(peft[f"{key}.lora_A.weight"], downs[j])
        assert torch.equal(peft[f"{key}.lora_B.weight"], ups[j])
        assert peft[f"base_model.model.transformer_blocks.1.attn.add_{x}_proj.lora_A.weight"].shape == (3 * r, H)
    ranks = {m: config["rank_pattern"].get(m, config["r"]) for m in config["target_modules"]}
    assert ranks == {f"transformer_blocks.1.attn.{m}": 2 if m.startswith("to_") else 6
                     for x in "qkv" for m in (f"to_{x}", f"add_{x}_proj")}  # fmt: skip
    assert_same_deltas(deltas(tmp_path / "p", folder / "transformer"), {
        k.split("/", 1)[1]: v for k, v in deltas(src, folder).items()
    }, exact=False)  # fmt: skip
