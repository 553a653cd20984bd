"""musubi-tuner / ComfyUI adapters for the video and newer image DiTs: Wan (diffusers' loader as referee, original
and diffusers layouts), HunyuanVideo, Qwen-Image and FramePack (detection of the base and kohya's merge formula)."""

from __future__ import annotations

import json

import pytest
import torch
from diffusion_helpers import _perturb, assert_matches, peft_merge, read_component, save

# diffusers' convert_wan_transformer_to_diffusers renames, the other way round (original Wan-Video names).
WAN_TO_ORIGINAL = [
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn1", "self_attn"),
    ("attn2", "cross_attn"),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("proj_out", "head.head"),
]


def tiny_wan():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
    )
    return _perturb(model, 0)


def wan_original(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if k == "scale_shift_table":
            out["head.modulation"] = v
            continue
        k = k.replace("scale_shift_table", "modulation").replace("norm2", "norm3")
        for new, old in WAN_TO_ORIGINAL:
            k = k.replace(new, old)
        out[f"model.diffusion_model.{k}"] = v
    return out


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    root = tmp_path_factory.mktemp("wan")
    model = tiny_wan()
    model.save_pretrained(root / "pipe" / "transformer")
    (root / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    original = wan_original(model.state_dict())
    back = convert_wan_transformer_to_diffusers(dict(original))
    assert set(back) == set(model.state_dict()) and all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    return model, root / "pipe", save(original, root / "wan2.1-tiny.safetensors")


def musubi_wan_lora(rank: int = 2) -> dict:
    """musubi-tuner networks/lora_wan.py: lora_unet_blocks_{i}_{self_attn,cross_attn}_{q,k,v,o}, _ffn_0, _ffn_2."""
    g = torch.Generator().manual_seed(4)
    out = {}
    for i in range(2):
        for m, (o, n) in {
            **{f"self_attn_{x}": (16, 16) for x in "qkvo"},
            **{f"cross_attn_{x}": (16, 16) for x in "qkvo"},
            "ffn_0": (32, 16),
            "ffn_2": (16, 32),
        }.items():
            name = f"lora_unet_blocks_{i}_{m}"
            out[f"{name}.lora_down.weight"] = torch.randn(rank, n, generator=g) * 0.2
            out[f"{name}.lora_up.weight"] = torch.randn(o, rank, generator=g) * 0.2
            out[f"{name}.alpha"] = torch.tensor(1.0)
    return out


def test_musubi_wan_lora_into_diffusers_folder_and_original_file_match_diffusers(wan, tmp_path, cli):
    import copy

    from diffusers.loaders.lora_pipeline import WanLoraLoaderMixin
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from safetensors.torch import load_file

    model, folder, single = wan
    lora = musubi_wan_lora()
    save(lora, tmp_path / "wan_lora.safetensors", {"ss_network_module": "networks.lora_wan"})
    reference_model = copy.deepcopy(model)
    sd = WanLoraLoaderMixin.lora_state_dict(dict(lora))
    WanLoraLoaderMixin.load_lora_into_transformer(sd, reference_model)
    reference = peft_merge(reference_model)
    base = model.state_dict()
    adapter = tmp_path / "wan_lora.safetensors"
    assert cli("merge", "--base", folder, "--adapter", adapter, "--out", tmp_path / "f")[0] == 0
    assert_matches(read_component(tmp_path / "f", "transformer"), reference, base, atol=1e-6)
    assert cli("merge", "--base", single, "--adapter", adapter, "--out", tmp_path / "s")[0] == 0
    merged = convert_wan_transformer_to_diffusers(load_file(tmp_path / "s" / "wan2.1-tiny.safetensors"))
    assert_matches(merged, reference, base, atol=1e-6)


def test_comfyui_wan_lora_on_the_diffusers_folder(wan, tmp_path, cli):
    """ComfyUI/ai-toolkit keys (diffusion_model.<original path>, lora_A/lora_B, alpha) on a diffusers layout."""
    model, folder, _ = wan
    g = torch.Generator().manual_seed(8)
    lora = {
        "diffusion_model.blocks.1.cross_attn.o.lora_A.weight": torch.randn(2, 16, generator=g),
        "diffusion_model.blocks.1.cross_attn.o.lora_B.weight": torch.randn(16, 2, generator=g),
        "diffusion_model.blocks.1.cross_attn.o.alpha": torch.tensor(4.0),
        "diffusion_model.blocks.0.ffn.2.diff_b": torch.randn(16, generator=g),
    }
    save(lora, tmp_path / "comfy.safetensors")
    assert cli("merge", "--base", folder, "--adapter", tmp_path / "comfy.safetensors", "--out", tmp_path / "m")[0] == 0
    ours, base = read_component(tmp_path / "m", "transformer"), model.state_dict()
    delta = (
        lora["diffusion_model.blocks.1.cross_attn.o.lora_B.weight"]
        @ lora["diffusion_model.blocks.1.cross_attn.o.lora_A.weight"]
    )
    torch.testing.assert_close(
        ours["blocks.1.attn2.to_out.0.weight"], base["blocks.1.attn2.to_out.0.weight"] + 2 * delta
    )
    torch.testing.assert_close(
        ours["blocks.0.ffn.net.2.bias"], base["blocks.0.ffn.net.2.bias"] + lora["diffusion_model.blocks.0.ffn.2.diff_b"]
    )


# Bases whose checkpoint keys are the names musubi flattens: a handful of real key names per family, tiny shapes.
FAMILIES = {
    "hunyuan_video": (
        [
            "double_blocks.0.img_attn_qkv.weight",
            "double_blocks.0.img_mlp.fc1.weight",
            "double_blocks.0.txt_attn_proj.weight",
            "single_blocks.0.linear1.weight",
            "single_blocks.0.linear2.weight",
            "img_in.proj.weight",
        ],
        [
            "lora_unet_double_blocks_0_img_attn_qkv",
            "lora_unet_double_blocks_0_img_mlp_fc1",
            "lora_unet_single_blocks_0_linear1",
        ],
    ),
    "qwen_image": (
        [
            "transformer_blocks.0.attn.to_q.weight",
            "transformer_blocks.0.attn.add_k_proj.weight",
            "transformer_blocks.0.img_mlp.net.0.proj.weight",
            "transformer_blocks.0.txt_mlp.net.2.weight",
            "img_in.weight",
        ],
        [
            "lora_unet_transformer_blocks_0_attn_to_q",
            "lora_unet_transformer_blocks_0_attn_add_k_proj",
            "lora_unet_transformer_blocks_0_img_mlp_net_0_proj",
        ],
    ),
    "framepack": (
        [
            "transformer_blocks.0.attn.to_q.weight",
            "transformer_blocks.0.ff_context.net.0.proj.weight",
            "single_transformer_blocks.0.proj_mlp.weight",
            "single_transformer_blocks.0.attn.to_k.weight",
            "clean_x_embedder.proj.weight",
        ],
        [
            "lora_unet_transformer_blocks_0_attn_to_q",
            "lora_unet_single_transformer_blocks_0_proj_mlp",
            "lora_unet_transformer_blocks_0_ff_context_net_0_proj",
        ],
    ),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."], ids=["original", "comfyui"])
def test_musubi_lora_on_each_family(family, prefix, tmp_path, cli):
    keys, modules = FAMILIES[family]
    g = torch.Generator().manual_seed(1)
    base = {prefix + k: torch.randn(8, 4, generator=g) for k in keys}
    single = save(base, tmp_path / f"{family}.safetensors")
    code, out, err = cli("inspect", single, "--json")
    assert code == 0, err
    info = json.loads(out)["details"]
    assert (
        info["keymap"] == family
        and info["layout"] == "single_file"
        and info["components"] == {"transformer": 5 + (family == "hunyuan_video")}
    )
    lora = {}
    for m in modules:
        lora |= {
            f"{m}.lora_down.weight": torch.randn(2, 4, generator=g),
            f"{m}.lora_up.weight": torch.randn(8, 2, generator=g),
            f"{m}.alpha": torch.tensor(1.0),
        }
    save(lora, tmp_path / "lora.safetensors")
    code, out, err = cli("merge", "--base", single, "--adapter", tmp_path / "lora.safetensors", "--out", tmp_path / "m")
    assert code == 0, err
    assert f"({family} keymap)" in out
    from safetensors.torch import load_file

    merged = load_file(tmp_path / "m" / f"{family}.safetensors")
    flat = {prefix + k: "lora_unet_" + k[: -len(".weight")].replace(".", "_") for k in keys}
    for key, name in flat.items():
        expected = (
            base[key] + (lora[f"{name}.lora_up.weight"] @ lora[f"{name}.lora_down.weight"]) / 2
            if name in modules
            else base[key]
        )
        torch.testing.assert_close(merged[key], expected, atol=1e-6, rtol=1e-6)


# HunyuanVideo original (tencent) module -> diffusers modules whose rows it concatenates (diffusers'
# convert_hunyuan_video_transformer_to_diffusers; it hard-codes the 3072 width for linear1, so it is mapped here).
def hunyuan_map(n: int = 2) -> dict[str, list[str]]:
    m = {}
    for i in range(n):
        d, t = f"double_blocks.{i}", f"transformer_blocks.{i}"
        m |= {
            f"{d}.img_attn_qkv": [f"{t}.attn.to_q", f"{t}.attn.to_k", f"{t}.attn.to_v"],
            f"{d}.txt_attn_qkv": [f"{t}.attn.add_q_proj", f"{t}.attn.add_k_proj", f"{t}.attn.add_v_proj"],
            f"{d}.img_attn_proj": [f"{t}.attn.to_out.0"],
            f"{d}.txt_attn_proj": [f"{t}.attn.to_add_out"],
            f"{d}.img_mlp.fc1": [f"{t}.ff.net.0.proj"],
            f"{d}.img_mlp.fc2": [f"{t}.ff.net.2"],
            f"{d}.txt_mlp.fc1": [f"{t}.ff_context.net.0.proj"],
            f"{d}.txt_mlp.fc2": [f"{t}.ff_context.net.2"],
            f"{d}.img_mod.linear": [f"{t}.norm1.linear"],
            f"{d}.txt_mod.linear": [f"{t}.norm1_context.linear"],
        }
        s, t = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        m |= {
            f"{s}.linear1": [f"{t}.attn.to_q", f"{t}.attn.to_k", f"{t}.attn.to_v", f"{t}.proj_mlp"],
            f"{s}.linear2": [f"{t}.proj_out"],
            f"{s}.modulation.linear": [f"{t}.norm.linear"],
        }
    return m


def hunyuan_original(sd: dict) -> dict:
    out, used = {}, set()
    for orig, parts in hunyuan_map().items():
        for p in ("weight", "bias"):
            out[f"{orig}.{p}"] = torch.cat([sd[f"{x}.{p}"] for x in parts])
            used.update(f"{x}.{p}" for x in parts)
    out |= {f"extra.{k}": v for k, v in sd.items() if k not in used}
    return out


def hunyuan_back(sd: dict, reference: dict) -> dict:
    out = {k[len("extra.") :]: v for k, v in sd.items() if k.startswith("extra.")}
    for orig, parts in hunyuan_map().items():
        for p in ("weight", "bias"):
            sizes = [reference[f"{x}.{p}"].shape[0] for x in parts]
            out |= dict(zip((f"{x}.{p}" for x in parts), torch.split(sd[f"{orig}.{p}"], sizes), strict=True))
    return out


def test_hunyuan_video_musubi_and_diffusers_loras_across_layouts(tmp_path, cli):
    """musubi's original-named LoRA (fused img_attn_qkv, linear1) into a diffusers-layout folder (split by rows)
    equals its merge into the original file; a diffusers-named LoRA into the original file (row slices) equals
    diffusers' own loader on the diffusers model."""
    import copy

    from diffusers import HunyuanVideoTransformer3DModel
    from diffusers.loaders.lora_pipeline import HunyuanVideoLoraLoaderMixin
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = _perturb(
        HunyuanVideoTransformer3DModel(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=8,
            num_layers=2,
            num_single_layers=2,
            num_refiner_layers=1,
            patch_size=1,
            text_embed_dim=12,
            pooled_projection_dim=8,
            rope_axes_dim=(2, 2, 4),
        ),
        0,
    )
    base = model.state_dict()
    model.save_pretrained(tmp_path / "pipe" / "transformer")
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanVideoPipeline"}))
    single = save(hunyuan_original(base), tmp_path / "hunyuan-tiny.safetensors")

    g = torch.Generator().manual_seed(1)
    musubi = {}
    for orig, parts in hunyuan_map().items():
        if "mod" in orig:  # musubi's default excludes img_mod / txt_mod / modulation
            continue
        rows, cols = sum(base[f"{p}.weight"].shape[0] for p in parts), base[f"{parts[0]}.weight"].shape[1]
        name = "lora_unet_" + orig.replace(".", "_")
        musubi |= {
            f"{name}.lora_down.weight": torch.randn(2, cols, generator=g),
            f"{name}.lora_up.weight": torch.randn(rows, 2, generator=g),
            f"{name}.alpha": torch.tensor(1.0),
        }
    save(musubi, tmp_path / "musubi.safetensors")
    for b, out in ((tmp_path / "pipe", "f"), (single, "s")):
        assert cli("merge", "--base", b, "--adapter", tmp_path / "musubi.safetensors", "--out", tmp_path / out)[0] == 0
    via_file = hunyuan_back(load_file(tmp_path / "s" / "hunyuan-tiny.safetensors"), base)
    assert_matches(read_component(tmp_path / "f", "transformer"), via_file, base, atol=1e-6)

    trained = copy.deepcopy(model)
    config = LoraConfig(
        r=2,
        lora_alpha=4,
        init_lora_weights=False,
        # the blocks only: the token refiner's attention (txt_in, fused self_attn_qkv) has no mapping yet
        target_modules=r".*transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|add_k_proj|to_out\.0)|proj_mlp|ff\.net\.0\.proj)",
    )
    trained.add_adapter(config)
    HunyuanVideoLoraLoaderMixin.save_lora_weights(
        tmp_path / "dlora",
        transformer_lora_layers=get_peft_model_state_dict(trained),
        transformer_lora_adapter_metadata=config.to_dict(),
    )
    adapter = tmp_path / "dlora" / "pytorch_lora_weights.safetensors"
    assert cli("merge", "--base", single, "--adapter", adapter, "--out", tmp_path / "d")[0] == 0
    merged = hunyuan_back(load_file(tmp_path / "d" / "hunyuan-tiny.safetensors"), base)
    assert_matches(merged, peft_merge(trained), base, atol=1e-5)
