"""FLUX.1 adapters into diffusers-layout and BFL single-file bases, with diffusers' own loader as the referee.

The BFL checkpoint is built from the diffusers transformer with the documented key map (docs/FORMATS.md §1
flux_merge_lora, §4): q/k/v fused into img_attn.qkv / txt_attn.qkv, q/k/v/mlp rows in single_blocks.N.linear1.
diffusers' own Flux converters hard-code FLUX.1's width (3072) for linear1, so the tiny model is mapped here.
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusion_helpers import _perturb, peft_merge, read_component, save, tiny_clip

H = 16  # hidden size of the tiny transformer


def tiny_flux(seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=12,
        pooled_projection_dim=12,
        axes_dims_rope=(2, 2, 4),
        guidance_embeds=True,
    )
    return _perturb(model, seed)


def tiny_t5():
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(3)
    cfg = T5Config(
        vocab_size=50, d_model=12, d_kv=4, d_ff=24, num_layers=2, num_heads=3, feed_forward_proj="gated-gelu"
    )
    return _perturb(T5EncoderModel(cfg), 3)


def bfl_map(n_double: int, n_single: int) -> dict[str, list[str]]:
    """BFL key -> the diffusers keys whose rows it concatenates (module names without the param)."""
    m = {
        "img_in": ["x_embedder"],
        "txt_in": ["context_embedder"],
        "final_layer.linear": ["proj_out"],
        "time_in.in_layer": ["time_text_embed.timestep_embedder.linear_1"],
        "time_in.out_layer": ["time_text_embed.timestep_embedder.linear_2"],
        "vector_in.in_layer": ["time_text_embed.text_embedder.linear_1"],
        "vector_in.out_layer": ["time_text_embed.text_embedder.linear_2"],
        "guidance_in.in_layer": ["time_text_embed.guidance_embedder.linear_1"],
        "guidance_in.out_layer": ["time_text_embed.guidance_embedder.linear_2"],
    }
    for i in range(n_double):
        d, t = f"double_blocks.{i}", f"transformer_blocks.{i}"
        m |= {
            f"{d}.img_attn.qkv": [f"{t}.attn.to_q", f"{t}.attn.to_k", f"{t}.attn.to_v"],
            f"{d}.txt_attn.qkv": [f"{t}.attn.add_q_proj", f"{t}.attn.add_k_proj", f"{t}.attn.add_v_proj"],
            f"{d}.img_attn.proj": [f"{t}.attn.to_out.0"],
            f"{d}.txt_attn.proj": [f"{t}.attn.to_add_out"],
            f"{d}.img_mlp.0": [f"{t}.ff.net.0.proj"],
            f"{d}.img_mlp.2": [f"{t}.ff.net.2"],
            f"{d}.txt_mlp.0": [f"{t}.ff_context.net.0.proj"],
            f"{d}.txt_mlp.2": [f"{t}.ff_context.net.2"],
            f"{d}.img_mod.lin": [f"{t}.norm1.linear"],
            f"{d}.txt_mod.lin": [f"{t}.norm1_context.linear"],
        }
    for i in range(n_single):
        s, t = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        m |= {
            f"{s}.linear1": [f"{t}.attn.to_q", f"{t}.attn.to_k", f"{t}.attn.to_v", f"{t}.proj_mlp"],
            f"{s}.linear2": [f"{t}.proj_out"],
            f"{s}.modulation.lin": [f"{t}.norm.linear"],
        }
    return m


def to_bfl(sd: dict, n: int = 2) -> dict:
    out, used = {}, set()
    for bfl, parts in bfl_map(n, n).items():
        for param in ("weight", "bias"):
            keys = [f"{p}.{param}" for p in parts]
            if all(k in sd for k in keys):
                out[f"{bfl}.{param}"] = torch.cat([sd[k] for k in keys])
                used.update(keys)
    for k, v in sd.items():  # norms and the final modulation, kept under their diffusers names here
        if k not in used:
            out[f"extra.{k}"] = v
    return out


def from_bfl(bfl: dict, reference: dict, n: int = 2) -> dict:
    out = {k[len("extra.") :]: v for k, v in bfl.items() if k.startswith("extra.")}
    for name, parts in bfl_map(n, n).items():
        for param in ("weight", "bias"):
            if f"{name}.{param}" not in bfl:
                continue
            sizes = [reference[f"{p}.{param}"].shape[0] for p in parts]
            for p, chunk in zip(parts, torch.split(bfl[f"{name}.{param}"], sizes), strict=True):
                out[f"{p}.{param}"] = chunk
    return out


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux")
    model = tiny_flux()
    folder = root / "pipeline"
    model.save_pretrained(folder / "transformer")
    tiny_clip(12).save_pretrained(folder / "text_encoder")
    tiny_t5().save_pretrained(folder / "text_encoder_2")
    (folder / "model_index.json").write_text(
        json.dumps({"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]})
    )
    bfl = save(to_bfl(model.state_dict()), root / "flux1-tiny.safetensors")
    assert from_bfl(to_bfl(model.state_dict()), model.state_dict()).keys() == model.state_dict().keys()
    return model, folder, bfl


def diffusers_reference(model, path) -> dict:
    """diffusers' FluxLoraLoaderMixin on the file (so it reads lora_adapter_metadata): its converters (kohya:
    alpha folded into A and B), then load_lora_into_transformer, merged by PEFT."""
    import copy

    from diffusers.loaders.lora_pipeline import FluxLoraLoaderMixin

    model = copy.deepcopy(model)
    sd, alphas, meta = FluxLoraLoaderMixin.lora_state_dict(
        str(path.parent), weight_name=path.name, return_alphas=True, return_lora_metadata=True
    )
    FluxLoraLoaderMixin.load_lora_into_transformer(sd, alphas, model, metadata=meta)
    return peft_merge(model)


def peft_style_lora(model, rank: int = 2) -> dict:
    """A diffusers-format Flux LoRA (what diffusers/ai-toolkit save): `transformer.<module>.lora_A/B.weight`."""
    g = torch.Generator().manual_seed(5)
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ("transformer_blocks" in name or name == "x_embedder"):
            out[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=g) * 0.2
            out[f"transformer.{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=g) * 0.2
    return out


def test_diffusers_flux_lora_into_folder_and_bfl_file(flux, tmp_path, cli):
    model, folder, bfl = flux
    lora = peft_style_lora(model)
    assert any(".single_transformer_blocks.0.proj_mlp." in k for k in lora)
    from peft import LoraConfig

    targets = sorted({k.split(".", 1)[1].rsplit(".lora_", 1)[0] for k in lora})
    config = LoraConfig(r=2, lora_alpha=4, target_modules=targets).to_dict()  # diffusers packs it per component
    packed = {f"transformer.{k}": sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    metadata = {"lora_adapter_metadata": json.dumps(packed)}
    save(lora, tmp_path / "lora.safetensors", metadata)
    reference = diffusers_reference(model, tmp_path / "lora.safetensors")
    base = model.state_dict()
    assert cli("merge", "--base", folder, "--adapter", tmp_path / "lora.safetensors", "--out", tmp_path / "f")[0] == 0
    from diffusion_helpers import assert_matches

    assert_matches(read_component(tmp_path / "f", "transformer"), reference, base, atol=1e-5)
    # into BFL's fused layout: to_q/to_k/to_v/proj_mlp land on row slices of qkv and linear1
    assert cli("merge", "--base", bfl, "--adapter", tmp_path / "lora.safetensors", "--out", tmp_path / "b")[0] == 0
    from safetensors.torch import load_file

    merged = load_file(tmp_path / "b" / "flux1-tiny.safetensors")
    assert_matches(from_bfl(merged, base), reference, base, atol=1e-5)


def kohya_flux_lora(model, with_linear1: bool, rank: int = 3) -> dict:
    """sd-scripts networks/lora_flux.py naming: lora_unet_<BFL module path, '.' -> '_'> with lora_down/up/alpha."""
    g = torch.Generator().manual_seed(9)
    sd = model.state_dict()
    out = {}
    for bfl, parts in bfl_map(2, 2).items():
        if not bfl.startswith(("double_blocks", "single_blocks")) or ("linear1" in bfl and not with_linear1):
            continue
        rows = sum(sd[f"{p}.weight"].shape[0] for p in parts)
        cols = sd[f"{parts[0]}.weight"].shape[1]
        name = "lora_unet_" + bfl.replace(".", "_")
        out[f"{name}.lora_down.weight"] = torch.randn(rank, cols, generator=g) * 0.2
        out[f"{name}.lora_up.weight"] = torch.randn(rows, rank, generator=g) * 0.2
        out[f"{name}.alpha"] = torch.tensor(2.0)
    return out


def test_kohya_flux_lora_into_bfl_file_matches_diffusers(flux, tmp_path, cli):
    """diffusers' kohya-Flux converter splits the fused qkv LoRA (A shared, B by rows) and folds alpha; its
    linear1 split assumes FLUX.1's 3072 width, so linear1 is checked with kohya's formula instead."""
    from safetensors.torch import load_file

    model, folder, bfl = flux
    base = model.state_dict()
    lora = kohya_flux_lora(model, with_linear1=False)
    save(lora, tmp_path / "lora.safetensors", {"ss_network_module": "networks.lora_flux"})
    assert cli("merge", "--base", bfl, "--adapter", tmp_path / "lora.safetensors", "--out", tmp_path / "b")[0] == 0
    reference = diffusers_reference(model, tmp_path / "lora.safetensors")
    from diffusion_helpers import assert_matches

    merged = load_file(tmp_path / "b" / "flux1-tiny.safetensors")
    assert_matches(from_bfl(merged, base), reference, base, atol=1e-5)

    lora = kohya_flux_lora(model, with_linear1=True)
    save(lora, tmp_path / "l1.safetensors")
    assert cli("merge", "--base", bfl, "--adapter", tmp_path / "l1.safetensors", "--out", tmp_path / "l1")[0] == 0
    merged, before = load_file(tmp_path / "l1" / "flux1-tiny.safetensors"), load_file(bfl)
    name = "lora_unet_single_blocks_1_linear1"
    delta = lora[f"{name}.lora_up.weight"] @ lora[f"{name}.lora_down.weight"] * (2.0 / 3)
    key = "single_blocks.1.linear1.weight"
    torch.testing.assert_close(merged[key], before[key] + delta, atol=1e-6, rtol=1e-6)


def test_comfyui_and_xlabs_flux_files(flux, tmp_path, cli):
    """ComfyUI / ai-toolkit `diffusion_model.<BFL path>` keys (alpha kept) and xlabs' processor LoRAs
    (`double_blocks.N.processor.qkv_lora1` = img_attn.qkv, `proj_lora2` = txt_attn.proj; scale 1)."""
    from safetensors.torch import load_file

    model, folder, bfl = flux
    g = torch.Generator().manual_seed(3)
    before = load_file(bfl)
    comfy = {
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.randn(2, H, generator=g),
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": torch.randn(3 * H, 2, generator=g),
        "diffusion_model.double_blocks.0.img_attn.qkv.alpha": torch.tensor(1.0),
        "diffusion_model.single_blocks.0.linear2.diff_b": torch.randn(H, generator=g),
    }
    save(comfy, tmp_path / "comfy.safetensors")
    assert cli("merge", "--base", bfl, "--adapter", tmp_path / "comfy.safetensors", "--out", tmp_path / "c")[0] == 0
    merged = load_file(tmp_path / "c" / "flux1-tiny.safetensors")
    p = "diffusion_model.double_blocks.0.img_attn.qkv"
    expected = (
        before["double_blocks.0.img_attn.qkv.weight"] + comfy[f"{p}.lora_B.weight"] @ comfy[f"{p}.lora_A.weight"] / 2
    )
    torch.testing.assert_close(merged["double_blocks.0.img_attn.qkv.weight"], expected, atol=1e-6, rtol=1e-6)
    bias = before["single_blocks.0.linear2.bias"] + comfy["diffusion_model.single_blocks.0.linear2.diff_b"]
    torch.testing.assert_close(merged["single_blocks.0.linear2.bias"], bias)

    xlabs = {
        "double_blocks.1.processor.qkv_lora1.down.weight": torch.randn(2, H, generator=g),
        "double_blocks.1.processor.qkv_lora1.up.weight": torch.randn(3 * H, 2, generator=g),
        "double_blocks.1.processor.proj_lora2.down.weight": torch.randn(2, H, generator=g),
        "double_blocks.1.processor.proj_lora2.up.weight": torch.randn(H, 2, generator=g),
    }
    save(xlabs, tmp_path / "xlabs.safetensors")
    assert cli("merge", "--base", bfl, "--adapter", tmp_path / "xlabs.safetensors", "--out", tmp_path / "x")[0] == 0
    merged = load_file(tmp_path / "x" / "flux1-tiny.safetensors")
    for proc, key in (("qkv_lora1", "img_attn.qkv"), ("proj_lora2", "txt_attn.proj")):
        d = (
            xlabs[f"double_blocks.1.processor.{proc}.up.weight"]
            @ xlabs[f"double_blocks.1.processor.{proc}.down.weight"]
        )
        k = f"double_blocks.1.{key}.weight"
        torch.testing.assert_close(merged[k], before[k] + d, atol=1e-6, rtol=1e-6)


def test_kohya_flux_lora_into_diffusers_folder_splits_fused_modules(flux, tmp_path, cli):
    """The usual case: a kohya (BFL-named) Flux LoRA and a diffusers-layout base. img_attn.qkv lands on
    to_q/to_k/to_v and linear1 on to_q/to_k/to_v/proj_mlp by rows of the delta; the result equals the merge
    into the BFL file (itself checked against diffusers above) mapped back to diffusers names."""
    from diffusion_helpers import assert_matches
    from safetensors.torch import load_file

    model, folder, bfl = flux
    base = model.state_dict()
    lora = kohya_flux_lora(model, with_linear1=True)
    save(lora, tmp_path / "lora.safetensors")
    assert cli("merge", "--base", folder, "--adapter", tmp_path / "lora.safetensors", "--out", tmp_path / "f")[0] == 0
    assert cli("merge", "--base", bfl, "--adapter", tmp_path / "lora.safetensors", "--out", tmp_path / "b")[0] == 0
    via_bfl = from_bfl(load_file(tmp_path / "b" / "flux1-tiny.safetensors"), base)
    changed = assert_matches(read_component(tmp_path / "f", "transformer"), via_bfl, base, atol=1e-6)
    assert changed == 2 * 14 + 2 * 6  # every projection of both double and both single blocks

    code, out, _ = cli("merge", "--base", folder, "--adapter", tmp_path / "lora.safetensors", "--dry-run")
    assert "RowsOf" in out


def test_fused_module_of_another_width_is_refused(flux, tmp_path, cli):
    model, folder, bfl = flux
    name = "lora_unet_double_blocks_0_img_attn_qkv"
    save(
        {f"{name}.lora_down.weight": torch.ones(2, H), f"{name}.lora_up.weight": torch.ones(4 * H, 2)},
        tmp_path / "bad.safetensors",
    )
    code, _, err = cli("merge", "--base", folder, "--adapter", tmp_path / "bad.safetensors", "--out", tmp_path / "m")
    assert code == 2 and "64 output rows" in err and "48 together" in err


def test_kohya_split_qkv_layout_is_pointed_out(flux, tmp_path, cli):
    """sd-scripts' split_qkv saves q/k/v LoRAs fused (down stacked, up block-diagonal) with the per-part alpha:
    merged with alpha / (3r) like every loader, and said so (docs/FORMATS.md §8, sd-scripts#2204)."""
    from safetensors.torch import load_file

    model, folder, bfl = flux
    g = torch.Generator().manual_seed(2)
    r, name = 2, "lora_unet_double_blocks_0_img_attn_qkv"
    downs = [torch.randn(r, H, generator=g) for _ in range(3)]
    ups = [torch.randn(H, r, generator=g) for _ in range(3)]
    lora = {
        f"{name}.lora_down.weight": torch.cat(downs),
        f"{name}.lora_up.weight": torch.block_diag(*ups),
        f"{name}.alpha": torch.tensor(4.0),
    }
    save(lora, tmp_path / "split.safetensors")
    code, out, err = cli("merge", "--base", bfl, "--adapter", tmp_path / "split.safetensors", "--out", tmp_path / "m")
    assert code == 0, err
    assert "split_qkv" in out and "sd-scripts issue 2204" in out
    merged, before = load_file(tmp_path / "m" / "flux1-tiny.safetensors"), load_file(bfl)
    delta = torch.cat([u @ d for u, d in zip(ups, downs, strict=True)]) * 4.0 / (3 * r)
    key = "double_blocks.0.img_attn.qkv.weight"
    torch.testing.assert_close(merged[key], before[key] + delta, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("t5_prefix", ["lora_te3", "lora_te2"], ids=["kohya-te3", "onetrainer-te2"])
def test_flux_text_encoder_loras_reach_clip_and_t5(flux, t5_prefix, tmp_path, cli):
    """kohya Flux: CLIP-L is lora_te1, T5 lora_te3 (sd-scripts) or lora_te2 (OneTrainer/LyCORIS); T5 names keep
    their case (SelfAttention, DenseReluDense). A BFL single file has no text encoders: they are unmatched there."""
    model, folder, bfl = flux
    g = torch.Generator().manual_seed(6)
    modules = {
        "lora_te1_text_model_encoder_layers_1_self_attn_q_proj": (
            "text_encoder",
            "encoder.layers.1.self_attn.q_proj",
            12,
            12,
        ),
        f"{t5_prefix}_encoder_block_0_layer_0_SelfAttention_q": (
            "text_encoder_2",
            "encoder.block.0.layer.0.SelfAttention.q",
            12,
            12,
        ),
        f"{t5_prefix}_encoder_block_1_layer_1_DenseReluDense_wi_0": (
            "text_encoder_2",
            "encoder.block.1.layer.1.DenseReluDense.wi_0",
            24,
            12,
        ),
    }
    lora = {}
    for name, (_, _, out_dim, in_dim) in modules.items():
        lora[f"{name}.lora_down.weight"] = torch.randn(2, in_dim, generator=g)
        lora[f"{name}.lora_up.weight"] = torch.randn(out_dim, 2, generator=g)
        lora[f"{name}.alpha"] = torch.tensor(1.0)
    save(lora, tmp_path / "te.safetensors")
    assert cli("merge", "--base", folder, "--adapter", tmp_path / "te.safetensors", "--out", tmp_path / "m")[0] == 0
    for name, (component, path, _, _) in modules.items():
        before, after = read_component(folder, component), read_component(tmp_path / "m", component)
        delta = lora[f"{name}.lora_up.weight"] @ lora[f"{name}.lora_down.weight"] / 2
        torch.testing.assert_close(after[f"{path}.weight"], before[f"{path}.weight"] + delta, atol=1e-6, rtol=1e-6)
    code, _, err = cli("merge", "--base", bfl, "--adapter", tmp_path / "te.safetensors", "--out", tmp_path / "b")
    assert code == 2 and "land on no base tensor" in err
