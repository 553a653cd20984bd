"""Tiny SDXL and Flux pipelines with kohya LoRAs for `make run` and the Space's tests: random models built from
configs (seconds, offline), complete enough that diffusers makes images with them, so a merge from the Space ends
with the base / reference / merged pictures for these families too.

The LoRAs use kohya sd-scripts' naming: SDXL `lora_unet_` / `lora_te1_` / `lora_te2_` on flattened module paths
with lora_down / lora_up / alpha (docs/FORMATS.md §1), Flux `lora_unet_double_blocks_N_img_attn_qkv` ... on BFL
module names (networks/lora_flux.py), the fused qkv landing on diffusers' separate to_q / to_k / to_v. One alpha
per file: diffusers' loader, the referee, misreads per-module alphas of SD-family files (§4).
"""

from __future__ import annotations

import json
from pathlib import Path

SDXL_BASE, SDXL_REPO = "demo/tiny-sdxl", "demo/tiny-sdxl-kohya"
SDXL_LORA = f"{SDXL_REPO}/tiny_sdxl_lora.safetensors"
FLUX_BASE, FLUX_REPO = "demo/tiny-flux", "demo/tiny-flux-kohya"
FLUX_LORA = f"{FLUX_REPO}/tiny_flux_lora.safetensors"
CARD = "---\nlibrary_name: diffusers\n---\n# {name} (demo)\nRandom, tiny.\n"


def _perturb(model, seed: int):
    """Norms start at 1 / 0 and some layers at zero: every tensor made non-trivial, so a wrong merge shows."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _clip(hidden: int, seed: int, projection: bool = False):
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(vocab_size=99, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16, projection_dim=hidden)  # fmt: skip
    torch.manual_seed(seed)
    return _perturb((CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg), seed)


def _write(folder: Path, pipeline: str, models: dict, scheduler: dict, name: str) -> None:
    folder.mkdir(parents=True)
    index = {"_class_name": pipeline, "_diffusers_version": "0.42.1"}
    for part, model in models.items():
        model.save_pretrained(folder / part)
        index[part] = ["transformers" if part.startswith("text_encoder") else "diffusers", type(model).__name__]
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler) + "\n")
    index["scheduler"] = ["diffusers", scheduler["_class_name"]]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    (folder / "README.md").write_text(CARD.format(name=name))


def tiny_sdxl(folder: Path) -> dict:
    """StableDiffusionXLPipeline: UNet with text_time embeddings, CLIP-L-like and OpenCLIP-G-like encoders."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2), cross_attention_dim=40, attention_head_dim=4, norm_num_groups=8,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=4,
        projection_class_embeddings_input_dim=24 + 6 * 4,
    )  # fmt: skip
    models = {"unet": _perturb(unet, 0), "text_encoder": _clip(16, 2), "text_encoder_2": _clip(24, 3, True)}
    torch.manual_seed(4)
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4, sample_size=8)
    _write(folder, "StableDiffusionXLPipeline", {**models, "vae": vae}, {"_class_name": "EulerDiscreteScheduler"},
           "Tiny SDXL")  # fmt: skip
    return models


def tiny_flux(folder: Path) -> dict:
    """FluxPipeline: a 2+2-block transformer, CLIP (pooled) and T5 encoders, a 2-channel VAE (packed 2x2 into the
    transformer's 8 input channels), flow-matching scheduler."""
    import torch
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=12, pooled_projection_dim=12, axes_dims_rope=(2, 2, 4), guidance_embeds=True,
    )  # fmt: skip
    torch.manual_seed(3)
    t5 = T5EncoderModel(T5Config(vocab_size=50, d_model=12, d_kv=4, d_ff=24, num_layers=2, num_heads=3,
                                 feed_forward_proj="gated-gelu"))  # fmt: skip
    models = {"transformer": _perturb(transformer, 0), "text_encoder": _clip(12, 2), "text_encoder_2": _perturb(t5, 3)}
    torch.manual_seed(4)
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=2, sample_size=8,
                        shift_factor=0.0, use_quant_conv=False, use_post_quant_conv=False)  # fmt: skip
    scheduler = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "use_dynamic_shifting": False}
    _write(folder, "FluxPipeline", {**models, "vae": vae}, scheduler, "Tiny Flux")
    return models


def _pair(sd: dict, name: str, out: int, inp: int, g, rank: int, alpha: float) -> None:
    import torch

    sd[f"{name}.lora_down.weight"] = torch.randn(rank, inp, generator=g) * 0.1
    sd[f"{name}.lora_up.weight"] = torch.randn(out, rank, generator=g) * 0.1
    sd[f"{name}.alpha"] = torch.tensor(alpha)


def sdxl_lora(models: dict, rank: int = 4) -> dict:
    """lora_unet_ on the UNet's transformer-block linears, lora_te1_ / lora_te2_ on both encoders' layers."""
    import torch
    from torch import nn

    g, sd = torch.Generator().manual_seed(7), {}
    targets = (("lora_unet", "unet", ".transformer_blocks."), ("lora_te1", "text_encoder", ".layers."),
               ("lora_te2", "text_encoder_2", ".layers."))  # fmt: skip
    for prefix, part, inside in targets:
        for path, m in models[part].named_modules():
            if isinstance(m, nn.Linear) and inside in f".{path}":
                path = f"text_model.{path}" if prefix != "lora_unet" and not path.startswith("text_model.") else path
                _pair(sd, f"{prefix}_{path}".replace(".", "_"), m.out_features, m.in_features, g, rank, 2.0)
    return sd


def flux_lora(models: dict, rank: int = 3) -> dict:
    """Double blocks in BFL names: fused img/txt qkv (rows q, k, v), attention outputs and MLPs."""
    import torch

    g, sd = torch.Generator().manual_seed(9), {}
    shapes = {k: v.shape for k, v in models["transformer"].state_dict().items()}
    for i in range(models["transformer"].config.num_layers):
        t = f"transformer_blocks.{i}"
        fused = {"img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                 "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
                 "img_attn_proj": ("attn.to_out.0",), "txt_attn_proj": ("attn.to_add_out",),
                 "img_mlp_0": ("ff.net.0.proj",), "img_mlp_2": ("ff.net.2",),
                 "txt_mlp_0": ("ff_context.net.0.proj",), "txt_mlp_2": ("ff_context.net.2",)}  # fmt: skip
        for bfl, parts in fused.items():
            rows = sum(shapes[f"{t}.{p}.weight"][0] for p in parts)
            cols = shapes[f"{t}.{parts[0]}.weight"][1]
            _pair(sd, f"lora_unet_double_blocks_{i}_{bfl}", rows, cols, g, rank, 2.0)
    return sd


def diffusion_repos(workdir: Path) -> dict[str, Path]:
    """{repo id: folder} for the SDXL and Flux bases and their LoRA repos."""
    from safetensors.torch import save_file

    out = {}
    for base, repo, lora, build, make, meta in (
        (SDXL_BASE, SDXL_REPO, SDXL_LORA, tiny_sdxl, sdxl_lora, {"ss_network_module": "networks.lora",
                                                              "ss_base_model_version": "sdxl_base_v1-0"}),
        (FLUX_BASE, FLUX_REPO, FLUX_LORA, tiny_flux, flux_lora, {"ss_network_module": "networks.lora_flux"}),
    ):  # fmt: skip
        folder = workdir / base.split("/")[1]
        models = build(folder)
        loras = workdir / repo.split("/")[1]
        loras.mkdir(parents=True)
        save_file(make(models), loras / lora.rsplit("/", 1)[1], metadata=meta)
        (loras / "README.md").write_text(f"---\nbase_model: {base}\n---\n# A kohya LoRA for {base} (demo)\n")
        out |= {base: folder, repo: loras}
    return out
